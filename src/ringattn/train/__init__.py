"""The trainer: a Llama-style model, data, the dp x cp run (FSDP2, DCP checkpoints), demo,
generate.
"""
