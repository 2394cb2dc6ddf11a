"""Hugging Face transformers models with context parallelism, through transformers' public seams.

    ringattn.hf.parallelize(model, group=None, layout="zigzag", strategy="ring")  # in place
    batch = ringattn.hf.shard_batch({"input_ids": ids, "labels": labels}, layout="zigzag")
    out = model(**batch)          # this rank's tokens only
    out.loss.backward()           # summed over the group: the single-device loss and gradients

Nothing here patches transformers. `parallelize` registers one attention function under the name
"ringattn" with `AttentionInterface.register` and one mask function with
`AttentionMaskInterface.register` (ringattn applies causality, documents and windows itself, so the
mask function builds no mask), switches the model to it with `set_attn_implementation`, and keeps
the process group, layout and strategy on the model's own modules (no global state). The batch side
is `shard_batch`: it shards the tokens, keeps global RoPE positions, shifts the labels on the
global sequence before sharding and passes the whole sequence's supervised-token count, so that
transformers' own causal-LM loss gives this rank's share of the single-device loss.

Modules: attention.py (the attention and mask functions), batch.py (shard_batch), agreement.py
(its check that every CP rank was given the same sequence), model.py
(parallelize), moe.py (the MoE router loss over the whole sequence), experts.py (expert
parallelism: experts split over ranks, tokens sent to them), vision.py (vision-language
models: the decoder's sequence cut), loss.py (chunked cross-entropy), tensor_parallel.py (the
model's own tp plan), source.py (loading a local model). Decoding over a sharded KV cache is
inference built on this package: ringattn/inference/hf/. This package imports transformers only
inside the functions that need it and never imports inference/, serve/, train/ or cli/.
"""

from ringattn.integrations.hf.attention import ATTENTION_NAME
from ringattn.integrations.hf.batch import shard_batch
from ringattn.integrations.hf.model import parallelize

__all__ = ["ATTENTION_NAME", "parallelize", "shard_batch"]
