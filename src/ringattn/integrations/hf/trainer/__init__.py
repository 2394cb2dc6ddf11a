"""Context parallelism inside the Hugging Face Trainer family: bring your own trainer.

    import ringattn.hf
    Trainer = ringattn.hf.with_context_parallel(trl.SFTTrainer)      # or transformers.Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      context_parallel=ringattn.hf.ContextParallelConfig(cp=2))
    trainer.train()                         # torchrun --nproc-per-node 4: dp 2 x cp 2

Modules: config.py (ContextParallelConfig, the (dp, cp) split of the world), batch.py (a collated
batch -> the one full row `shard_batch` takes), wrap.py (with_context_parallel: the Trainer hooks
it overrides, and what it refuses). `trainer_class()` is `ringattn.hf.Trainer`, built on first use
so that `import ringattn.hf` does not import the Trainer (and accelerate).
"""

from ringattn.integrations.hf.trainer.config import ContextParallelConfig
from ringattn.integrations.hf.trainer.wrap import with_context_parallel


def trainer_class() -> type:
    """`with_context_parallel(transformers.Trainer)`."""
    import transformers

    return with_context_parallel(transformers.Trainer)


__all__ = ["ContextParallelConfig", "trainer_class", "with_context_parallel"]
