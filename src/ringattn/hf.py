"""`ringattn.hf`: Hugging Face transformers models with context parallelism.

    import ringattn.hf
    ringattn.hf.parallelize(model, group=None, layout="zigzag", strategy="ring")
    batch = ringattn.hf.shard_batch({"input_ids": ids, "labels": labels}, layout="zigzag")
    model(**batch).loss.backward()

A thin façade over ringattn.integrations.hf (see there and docs/hf.md). Importing it imports
transformers (`pip install ringattn[hf]`); `import ringattn` alone does not.
"""

from ringattn.integrations.hf import parallelize, shard_batch
from ringattn.integrations.hf.generate import generate  # decoding over a sharded KV cache
from ringattn.integrations.hf.session import Session  # follow-up turns over the cache

__all__ = ["Session", "generate", "parallelize", "shard_batch"]
