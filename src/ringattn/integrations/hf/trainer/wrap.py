"""`with_context_parallel(TrainerClass)`: a transformers Trainer (or TRL's SFTTrainer, or any
subclass) whose ranks form data-parallel groups of `cp` context-parallel ranks.

What a hand-wired Trainer gets wrong, and the documented hook that puts it right here:

    its sampler gives every rank its own      get_train/eval/test_dataloader: the prepared
    batch; a CP group must share one          loader's shard (accelerate's BatchSamplerShard, as
                                              the Trainer does for its rebalancing sampler) reads
                                              by dp rank: dp groups, not ranks
    the model sees whole sequences            __init__: ringattn.hf.parallelize on the cp group
                                              (a PeftModel's base model); compute_loss: the
                                              batch -> one row (batch.py) -> shard_batch
    the loss keeps (tokens, vocab) logits     chunked.py: transformers.Trainer's training loss
                                              through lm_head a chunk of rows at a time
    num_items_in_batch counts every rank      get_cp_size: the Trainer divides its all-rank
                                              count by it, giving the global batch's count
    DDP averages gradients over all W ranks   the Trainer already multiplies a token-normalised
                                              loss by W (average_tokens_across_devices): each
                                              rank's loss is its token-loss sum / the global
                                              count, so the gradients come out summed over cp
                                              and averaged over dp, under DDP or FSDP alike
    eval losses are one rank's                prediction_step: the cp group's sum (the batch's
                                              mean), gathered once per dp group
    SFTTrainer's MoE router loss is one       router.py: its router logits gathered over the cp
    rank's                                    group
    dynamic CP (ContextParallelConfig(        dynamic.py: each training batch's documents of
    dynamic=True))                            every dp row placed over all ranks; `log` adds the
                                              step's cp_groups and imbalance

The logged training loss is the Trainer's own mean over ranks of W x (sum / global count): the
global token mean. Checkpoints and `save_model` are the Trainer's: DDP keeps the whole model on
every rank (FSDP's own state-dict settings apply), so rank 0 writes all of it.

Settings that cannot be honoured raise ValueError in the constructor, on every rank (they are
read from the arguments all ranks share), naming the setting. So does a model whose experts
`parallelize(expert_group=...)` split over ranks: DDP and FSDP here replicate over all W ranks
(train --hf has expert parallelism, FSDP2 over the ranks holding the same experts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringattn.integrations.hf.batch import shard_batch
from ringattn.integrations.hf.dynamic import refuse_dynamic
from ringattn.integrations.hf.experts import EXPERTS_ATTR
from ringattn.integrations.hf.levers.offload import check_trainer_args as check_offload_args
from ringattn.integrations.hf.levers.offload import offload_activations
from ringattn.integrations.hf.model import parallelize
from ringattn.integrations.hf.trainer.batch import one_row
from ringattn.integrations.hf.trainer.chunked import install_chunked_loss
from ringattn.integrations.hf.trainer.config import ContextParallelConfig, split_world
from ringattn.integrations.hf.trainer.dynamic import DynamicSharder
from ringattn.integrations.hf.trainer.router import gather_router_logits

__all__ = ["with_context_parallel"]

_CLASSES: dict[type, type] = {}


def _refuse(trainer: object, extra_settings: dict) -> None:
    """ValueError naming the first setting context parallelism cannot honour."""
    args = trainer.args
    bad = {
        "compute_metrics": "it needs whole logits; the CP ranks hold shards (eval reports the "
        "loss only)",
        "preprocess_logits_for_metrics": "it needs whole logits; the CP ranks hold shards",
        "compute_loss_func": "it receives one rank's logits with unshifted labels",
        "model_init": "the model must exist when the Trainer is built, to be parallelized",
    }
    for name, why in bad.items():
        if extra_settings.get(name) is not None:
            raise ValueError(f"ringattn.hf Trainer: {name} is not supported: {why}")
    dispatch = bool(getattr(args.accelerator_config, "dispatch_batches", False))
    checks = [
        (not args.average_tokens_across_devices, "average_tokens_across_devices=False",
         "the loss is normalised by the global count of supervised tokens; set it to True"),
        (args.label_smoothing_factor != 0, f"label_smoothing_factor={args.label_smoothing_factor}",
         "label smoothing reads whole logits; set it to 0"),
        (bool(args.deepspeed), "deepspeed", "use DDP (the default) or FSDP (fsdp=...)"),
        (args.train_sampling_strategy == "batch_rebalance",
         "train_sampling_strategy='batch_rebalance'",
         "its sampler reads by rank, not by data-parallel group"),
        (dispatch, "accelerator_config.dispatch_batches=True",
         "rank 0 would dispatch a different batch to every rank"),
        (getattr(args, "parallelism_config", None) is not None, "parallelism_config",
         "accelerate's own cp/sp/tp would shard the sequence a second time"),
        (args.n_gpu > 1, f"n_gpu={args.n_gpu} (nn.DataParallel)",
         "launch one process per device with torchrun or accelerate launch"),
    ]  # fmt: skip
    for failed, setting, fix in checks:
        if failed:
            raise ValueError(f"ringattn.hf Trainer: {setting} is not supported: {fix}")


def _refuse_for_dynamic(trainer: object, model: torch.nn.Module) -> None:
    """ValueError for what ContextParallelConfig(dynamic=True) cannot run exactly: the model's
    (integrations/hf/dynamic.py) and the Trainer's settings that were not made exact with it."""
    what = "ContextParallelConfig(dynamic=True)"
    args = trainer.args
    if args.torch_compile:  # the segments' groups and bounds change every step: not traced
        raise ValueError(f"ringattn.hf Trainer: {what} is not supported with torch_compile=True; "
                         f"set it to False, or use static CP (dynamic=False)")  # fmt: skip
    refuse_dynamic(model, what)


def _refuse_split_experts(model: torch.nn.Module) -> None:
    """ValueError for a model whose experts `parallelize(expert_group=...)` split over several
    ranks: the Trainer's DDP (or FSDP) takes every rank's weights for copies of one model, so it
    would broadcast rank 0's experts over the others' and average different experts' gradients.
    Read from the model alone (every rank holds the same structure): raised on every rank."""
    for name, module in model.named_modules():
        shard = getattr(module, EXPERTS_ATTR, None)
        if shard is not None and shard.info.world_size > 1:
            raise ValueError(
                f"ringattn.hf Trainer: the model's experts are split over an expert group "
                f"(parallelize(expert_group=...), {shard.info.world_size} ranks, e.g. {name}), "
                f"which the Trainer's DDP/FSDP would take for copies of one model (rank 0's "
                f"experts broadcast over the others', gradients of different experts averaged); "
                f"give the Trainer the model without expert_group (every rank holds every "
                f"expert), or train expert parallelism with `ringattn train --hf DIR --ep E`"
            )


def _by_data_parallel_rank(loader: object, dp: int, dp_rank: int, world: int) -> object:
    """Make an accelerate-prepared loader shard its batches over dp groups instead of ranks."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    if world == 1:  # one process (e.g. `accelerate launch --cpu`): accelerate shards nothing
        return loader

    for attribute in ("batch_sampler", "sampler", "dataset"):
        shard = getattr(loader, attribute, None)
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            shard.num_processes, shard.process_index = dp, dp_rank
            return loader
    raise ValueError(
        f"ringattn.hf Trainer: cannot make the ranks of a CP group share batches with this data "
        f"loader ({type(loader).__name__} over {type(getattr(loader, 'dataset', None)).__name__}"
        f"); use a map-style dataset or a torch IterableDataset"
    )


def _own_compute_loss(cls: type) -> bool:
    """Whether, ours aside, `cls` computes the loss with transformers.Trainer's own compute_loss
    (a subclass's, above or below ours, may read the logits)."""
    import transformers

    owners = [c for c in cls.__mro__ if "compute_loss" in vars(c) and c is not _ContextParallel]
    return owners[0] is transformers.Trainer


class _ContextParallel:
    """The overrides; `with_context_parallel` puts this class first in the subclass's MRO."""

    def __init__(self, *args, context_parallel: ContextParallelConfig | None = None, **kwargs):
        if context_parallel is not None and not isinstance(context_parallel, ContextParallelConfig):
            raise TypeError(
                f"context_parallel must be a ringattn.hf.ContextParallelConfig, got "
                f"{type(context_parallel).__name__}"
            )
        extra = {k: kwargs.get(k) for k in ("compute_metrics", "preprocess_logits_for_metrics",
                                            "compute_loss_func", "model_init")}  # fmt: skip
        super().__init__(*args, **kwargs)
        if context_parallel is None:  # one CP group over every rank
            world = dist.get_world_size() if dist.is_initialized() else 1
            context_parallel = ContextParallelConfig(cp=world)
        _refuse(self, extra)
        if context_parallel.offload_activations:  # read from the arguments: on every rank, first
            check_offload_args(self.args)
        model = self.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
        if context_parallel.dynamic:  # read from the model and arguments: on every rank, first
            _refuse_for_dynamic(self, base)
        self.context_parallel = context_parallel
        self.cp_split = split_world(context_parallel)
        _refuse_split_experts(base)
        if context_parallel.tiled_mlp and self.args.torch_compile:
            raise ValueError(
                f"ringattn.hf Trainer: ContextParallelConfig(tiled_mlp="
                f"{context_parallel.tiled_mlp}) is not supported with torch_compile=True (its "
                f"tiles are recomputed by a Python autograd function); set one of them off"
            )
        parallelize(base, self.cp_split.group, context_parallel.layout, context_parallel.strategy,
                    backend=context_parallel.backend,
                    mixer_scheme=context_parallel.mixer_scheme,
                    tiled_mlp=context_parallel.tiled_mlp)  # fmt: skip
        if context_parallel.offload_activations:  # train() enables checkpointing: wrap then
            offload_activations(base, when_checkpointed=True)
        if getattr(self, "aux_loss_enabled", False):  # SFTTrainer's own MoE router loss
            gather_router_logits(base)
        if _own_compute_loss(type(self)):  # a subclass's compute_loss may read the logits
            install_chunked_loss(base, context_parallel.loss_chunk)
        if self.cp_split.cp > 1:
            self.gather_function = self._gather_by_dp_group
        self.cp_dynamic = None  # the sub-groups, created once (collective), then every step's
        if context_parallel.dynamic:
            half = bool(self.args.bf16 or self.args.fp16)
            self.cp_dynamic = DynamicSharder(self.cp_split, context_parallel.layout, base, half)

    def get_cp_size(self) -> int:
        """The Trainer divides its all-rank token count and its dp world size by this."""
        return self.cp_split.cp

    @property
    def _grid(self) -> tuple[int, int, int]:
        return self.cp_split.dp, self.cp_split.dp_rank, self.accelerator.num_processes

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        return _by_data_parallel_rank(loader, *self._grid)

    def get_eval_dataloader(self, eval_dataset=None):
        loader = super().get_eval_dataloader(eval_dataset)
        return _by_data_parallel_rank(loader, *self._grid)

    def get_test_dataloader(self, test_dataset):
        loader = super().get_test_dataloader(test_dataset)
        return _by_data_parallel_rank(loader, *self._grid)

    def _shard(self, inputs: dict, count: object, training: bool = False) -> dict:
        row, flags = one_row(inputs)
        if training and self.cp_dynamic is not None:  # collective over the world (dynamic.py)
            return {**self.cp_dynamic.shard(row, count), **flags}
        if count is not None and "labels" in row:
            row["num_items_in_batch"] = count
        local = shard_batch(row, self.cp_split.group, self.context_parallel.layout)
        return {**local, **flags}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's shard through the Trainer's own loss, over the global supervised-token
        count (the Trainer then scales it by the world size for DDP's average)."""
        if num_items_in_batch is None and model.training and "labels" in inputs:
            raise ValueError(
                "ringattn.hf Trainer: the Trainer passed no num_items_in_batch; context "
                "parallelism needs the global count of supervised tokens: the model's forward "
                "must accept transformers' loss kwargs (**kwargs)"
            )
        local = self._shard(inputs, num_items_in_batch, training=model.training)
        return super().compute_loss(model, local, return_outputs, num_items_in_batch)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """The Trainer's log, with dynamic CP's cp_groups and imbalance beside a training loss."""
        if self.cp_dynamic is not None and "loss" in logs:
            logs = {**logs, **self.cp_dynamic.take_log()}
        super().log(logs, *args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The eval loss of the dp group's batch (the same on its cp ranks); no logits."""
        inputs = self._prepare_inputs(inputs)
        local = self._shard(inputs, None)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**local)
        loss = outputs["loss"] if isinstance(outputs, dict) else None
        if loss is None:
            return None, None, None
        loss = loss.detach().float()
        if self.cp_split.group is not None and self.cp_split.cp > 1:
            dist.all_reduce(loss, group=self.cp_split.group)  # shares of the mean -> the mean
        return loss, None, None

    def _gather_by_dp_group(self, tensors, *args, **kwargs):
        """The Trainer's gather_for_metrics, once per dp group (its cp ranks hold copies)."""
        gathered = self.accelerator.gather(tensors)  # (W * n, ...): rank-major
        split = self.cp_split
        gathered = gathered.reshape(split.dp, split.cp, -1, *gathered.shape[1:])[:, 0]
        gathered = gathered.reshape(-1, *gathered.shape[2:])
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            gathered = gathered[: state.remainder]  # the last batch's repeated samples
        return gathered


def with_context_parallel(trainer_class: type) -> type:
    """A subclass of `trainer_class` (transformers.Trainer or a subclass, e.g. TRL's SFTTrainer)
    whose constructor takes `context_parallel=ContextParallelConfig(cp=..., layout=...,
    strategy=...)`. The same class comes back for the same argument."""
    import transformers

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(
            f"with_context_parallel takes transformers.Trainer or a subclass of it, got "
            f"{trainer_class!r}"
        )
    if issubclass(trainer_class, _ContextParallel):
        return trainer_class
    if trainer_class not in _CLASSES:
        name = f"ContextParallel{trainer_class.__name__}"
        _CLASSES[trainer_class] = type(name, (_ContextParallel, trainer_class), {
            "__module__": __name__, "__doc__": f"{trainer_class.__name__} with context "
            f"parallelism (ringattn.hf.with_context_parallel)."})  # fmt: skip
    return _CLASSES[trainer_class]
