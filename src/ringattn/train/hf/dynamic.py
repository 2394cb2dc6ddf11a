"""`ringattn train --hf DIR --dynamic-cp`: a transformers model's packed documents, each step
given cp groups of their own size by the decoder's scheduler (train/dynamic/).

    hf/data.py windows          text: or chat:, positions restarting at every document start
      -> Windows.sample(i)      (input_ids, labels shifted inside each document, bounds): the
                                interface of train/dynamic/documents.DocumentTask
      -> dynamic.DocumentLoader the step's documents of every dp row, plan_step (unchanged),
                                this rank's pieces end to end and their Segments
      -> DynamicBatch           the model's kwargs: input_ids, position_ids (restarting per
                                document: RoPE exactly as static CP), use_cache=False, and
                                `ringattn_segments`, which transformers hands on to every
                                layer's attention function (integrations/hf/attention.py)

Exact by construction, as the decoder's: the windows are those static CP reads at the step
(samples step*dp*B ..), the documents are static CP's (shard_batch finds them where positions
restart, and so does `bounds` here), the labels are shifted inside each document as
`shift_labels` does on the whole row, each supervised token sits on one rank once, the loss is
divided by the global supervised count (train/step.py) and FSDP2 sums the gradients over every
rank. A rank the schedule gives no document trains a one-token unsupervised document alone
(train/dynamic/loader.py), so it still runs the step's one forward and backward and FSDP2's
collectives meet; its token is in no loss and in no MoE router statistic (router loss is
refused, see `refuse`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringattn.integrations.hf.attention import SEGMENTS_KWARG
from ringattn.integrations.hf.batch import shift_labels
from ringattn.integrations.hf.dynamic import refuse_dynamic
from ringattn.integrations.hf.source import load_model, model_source
from ringattn.planner.dynamic_cp.cost import DocumentCost
from ringattn.planner.models import from_hf_config
from ringattn.runtime.mesh import Mesh
from ringattn.runtime.subgroups import build_sub_groups
from ringattn.train.config import TrainConfig
from ringattn.train.dynamic.loader import DocumentLoader
from ringattn.train.hf.context import extended_config
from ringattn.train.hf.data import PackedConversations, PackedDocuments

__all__ = ["DynamicBatch", "DynamicLoader", "Windows", "check_model", "dynamic_loader"]


@dataclass(frozen=True)
class Windows:
    """--hf windows as DocumentTask's `sample(i) -> (inputs, labels, cu_seqlens)`."""

    dataset: PackedDocuments | PackedConversations

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        sample = self.dataset.sample(index)
        ids, positions = sample[0], sample[1]
        labels = sample[2] if len(sample) > 2 else ids  # text: every token is a label
        starts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
        bounds = [0, *starts.tolist(), len(ids)]  # where shard_batch finds the documents
        return ids, shift_labels(labels[None], bounds)[0], tuple(bounds)


@dataclass
class DynamicBatch:
    """One rank's pieces as the HF recipe's batch (hf/data.DocumentBatch's shape) plus the
    step's schedule summary for the log."""

    inputs: dict
    labels: torch.Tensor
    positions: torch.Tensor
    cp_groups: dict[str, int]
    imbalance: float


@dataclass(frozen=True)
class DynamicLoader:
    """`batch(step)`: train/dynamic/loader.py's pieces as transformers keyword arguments."""

    documents: DocumentLoader

    def batch(self, step: int) -> DynamicBatch:
        b = self.documents.batch(step)
        positions = b.positions[None]  # (1, S_local): restart at 0 in every document
        inputs = {"input_ids": b.inputs, "position_ids": positions, "use_cache": False,
                  SEGMENTS_KWARG: b.segments}  # fmt: skip
        return DynamicBatch(inputs, b.labels, positions, b.cp_groups, b.imbalance)


def dynamic_loader(
    cfg: TrainConfig, mesh: Mesh, device: torch.device, dataset: PackedDocuments
) -> DynamicLoader:
    """The sub-groups (collective: every rank, once, here) and the loader of --dynamic-cp."""
    spec = from_hf_config(model_source(cfg.hf).config_file)
    cost = DocumentCost(spec, elem_bytes=4 if cfg.dtype == "float32" else 2)
    groups = build_sub_groups(mesh.dp, mesh.cp, mesh.cp_group, mesh.cp_rank)
    documents = DocumentLoader(Windows(dataset), cfg.batch_size, mesh.dp_rank, mesh.dp, mesh.cp,
                               groups, cfg.layout, device, cost, dynamic=True)  # fmt: skip
    return DynamicLoader(documents)


def check_model(cfg: TrainConfig) -> None:
    """--dynamic-cp's refusals that need the model's structure (hybrid mixers, vision, MoE
    router loss): read from the model built on the meta device, before any process group."""
    with torch.device("meta"):
        model = load_model(model_source(cfg.hf), pretrained=False, config=extended_config(cfg))
    refuse_dynamic(model, "--dynamic-cp")
