"""`ringattn.hf`: Hugging Face transformers models with context parallelism.

    import ringattn.hf
    ringattn.hf.parallelize(model, group=None, layout="zigzag", strategy="ring")
    batch = ringattn.hf.shard_batch({"input_ids": ids, "labels": labels}, layout="zigzag")
    model(**batch).loss.backward()
    ringattn.hf.loss(model, batch, chunk=1024).backward()    # the same, logits never whole
    tokens = ringattn.hf.generate(model, input_ids, 64)      # decoding over a sharded KV cache
    trainer = ringattn.hf.Trainer(model=m, args=a, train_dataset=d,   # transformers.Trainer
                                  context_parallel=ringattn.hf.ContextParallelConfig(cp=2))
    ringattn.hf.with_context_parallel(trl.SFTTrainer)                 # any Trainer subclass
    ringattn.hf.SUPPORTED_FAMILIES    # the config.model_type values parallelize accepts

A thin façade over ringattn.integrations.hf (training: attention, batches, loss) and
ringattn.inference.hf (decoding); see docs/hf.md. It needs transformers (`pip install
'ringattn[hf]'`) and says so on import; `import ringattn` alone never imports transformers.
"""

try:
    import transformers  # noqa: F401 - the reason this module exists; checked once, here
except ImportError as err:  # pragma: no cover - exercised by the bare-install test
    raise ImportError(
        "ringattn.hf needs transformers, which is in the hf extra: pip install 'ringattn[hf]'"
    ) from err

from ringattn.inference.hf.generate import generate  # decoding over a sharded KV cache
from ringattn.inference.hf.session import Session  # follow-up turns over the cache
from ringattn.integrations.hf import parallelize, shard_batch
from ringattn.integrations.hf.families import SUPPORTED_FAMILIES  # the allow-list, sorted
from ringattn.integrations.hf.loss import loss  # chunked cross-entropy: logits never whole
from ringattn.integrations.hf.trainer import (
    ContextParallelConfig,
    trainer_class,
    with_context_parallel,
)


def __getattr__(name: str) -> object:
    if name == "Trainer":  # with_context_parallel(transformers.Trainer), built on first use
        return trainer_class()
    raise AttributeError(f"module 'ringattn.hf' has no attribute {name!r}")


__all__ = ["SUPPORTED_FAMILIES", "ContextParallelConfig", "Session", "Trainer",  # noqa: F822
           "generate", "loss", "parallelize", "shard_batch", "with_context_parallel"]  # fmt: skip
