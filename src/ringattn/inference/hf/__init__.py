"""Decoding a Hugging Face transformers model over a sharded KV cache (`ringattn.hf.generate`).

    engine.py        KVEngine: one model over the cache: packed prefill, batched decode steps,
                     follow-up turns (pass-KV / pass-Q from ../turns.py); the one engine of
                     both model kinds (ringattn's decoder through ../native.py)
    kv_attention.py  the "ringattn-kv" attention function the engine switches the model to: the
                     cache (../cache.py) and exact merges of per-rank partials (../partials.py)
    batching.py      generate's arguments checked and spread to one setting per prompt
    generate.py      `generate`: prompts -> tokens (greedy or sampled, ../sampling.py)
    session.py       `Session`: a conversation over a persistent cache

This is inference built on the integration: it imports `integrations/hf/` (the attention call's
checks, the mask function, vision-language hooks), never the reverse. transformers is needed by
the models it runs, not by these modules' imports.
"""
