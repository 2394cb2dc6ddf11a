"""A collated Trainer batch -> the one full sequence `shard_batch` takes.

A CP group shares one batch; `shard_batch` takes it as one (1, S) row of documents. Collators
give three shapes, all turned into that row without changing what the model computes:

    padded (B, S) + attention_mask        row i's real tokens (mask 1...1 0..0, right padding)
    (DataCollatorWithPadding,             become document i; its positions are 0..n_i-1, as
     TRL without padding-free)            transformers numbers them; the padding is dropped

    a0 a1 a2 .  .                         a0 a1 a2 | b0 b1 b2 b3 b4 | c0      cu_seqlens
    b0 b1 b2 b3 b4                        0 1 2      0 1 2 3 4       0       [0, 3, 8, 9]
    c0 .  .  .  .

    padding-free (1, S) + position_ids    the row as it is: documents start where the
    (DataCollatorWithFlattening,          positions restart (TRL's cu_seq_lens_q, when given,
     TRL packing / padding_free)          are the same bounds)

    (B, S) rows without a mask            each row a document (positions restarting per row)

Labels are the collator's (unshifted, -100 = unsupervised: prompts under completion_only_loss,
non-assistant turns under assistant_only_loss); `shard_batch` shifts them inside each document,
so a document's last token predicts nothing, as in the per-row loss of one device. Left padding
is refused: transformers would give its real tokens shifted positions and let a padding row
predict the first real token, which a packed row cannot reproduce.
"""

from __future__ import annotations

import torch

__all__ = ["PASSED", "one_row"]

_DROPPED = ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
            "seq_idx", "seq_lengths")  # fmt: skip
PASSED = ("use_cache", "output_router_logits", "return_dict", "output_attentions")
"""Keyword arguments passed to the model unchanged (flags, not per-token tensors)."""
_TAKEN = ("input_ids", "labels", "position_ids")


def _check_keys(inputs: dict) -> None:
    unknown = sorted(set(inputs) - {*_DROPPED, *PASSED, *_TAKEN})
    if unknown:
        raise ValueError(
            f"ringattn.hf Trainer: the batch has the keys {unknown}, which context parallelism "
            f"cannot shard; it takes {list(_TAKEN)} with attention_mask (right padding) or "
            f"position_ids (padding-free). Drop those columns (remove_unused_columns=True) or "
            f"use a collator that does not add them"
        )
    if "input_ids" not in inputs:
        raise ValueError("ringattn.hf Trainer: the batch has no input_ids (inputs_embeds cannot "
                         "be sharded by the Trainer integration)")  # fmt: skip


def _lengths(mask: torch.Tensor) -> list[int]:
    """Each row's real-token count; ValueError unless every row is ones then zeros."""
    lengths = mask.sum(1)
    columns = torch.arange(mask.shape[1], device=mask.device)
    prefix = (columns[None, :] < lengths[:, None]).to(mask.dtype)
    if not torch.equal(mask, prefix):
        raise ValueError(
            "ringattn.hf Trainer: the attention_mask is not right padding (each row ones then "
            "zeros); set the tokenizer's padding_side='right' for training, or use a "
            "padding-free collator (DataCollatorWithFlattening, TRL's padding_free=True)"
        )
    return lengths.tolist()


def _bounds_from(positions: torch.Tensor, lengths: list[int]) -> list[int]:
    """Document bounds over the concatenated real tokens: every row start, and every restart of
    the positions inside a row."""
    starts, offset = set(), 0
    for row, n in enumerate(lengths):
        if n == 0:
            continue
        pos = positions[row, :n].to("cpu", torch.int64)
        inner = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
        starts.update([offset, *(inner + offset).tolist()])
        offset += n
    return [*sorted(starts), offset]


def one_row(inputs: dict) -> tuple[dict, dict]:
    """(`shard_batch`'s dict: input_ids, labels, position_ids, cu_seqlens; the PASSED flags)."""
    _check_keys(inputs)
    ids = inputs["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"ringattn.hf Trainer: input_ids must be (batch, seq), got "
                         f"{getattr(ids, 'shape', type(ids).__name__)}")  # fmt: skip
    batch, seq_len = ids.shape
    mask = inputs.get("attention_mask")
    lengths = _lengths(mask) if mask is not None else [seq_len] * batch
    positions = inputs.get("position_ids")
    if positions is None:
        columns = torch.arange(seq_len, device=ids.device)
        positions = columns.expand(batch, seq_len)  # transformers' own numbering of each row
    if positions.dim() != 2 or tuple(positions.shape) != (batch, seq_len):
        raise ValueError(
            f"ringattn.hf Trainer: position_ids of shape {tuple(positions.shape)} for input_ids "
            f"{tuple(ids.shape)}; 3-D (M-RoPE) positions are not supported by the Trainer "
            f"integration"
        )
    bounds = _bounds_from(positions, lengths)
    cu = inputs.get("cu_seq_lens_q")
    if cu is not None and batch == 1 and mask is None:
        bounds = [int(b) for b in torch.as_tensor(cu, device="cpu").tolist()]  # TRL's: the same
    rows = range(batch)
    row = {
        "input_ids": torch.cat([ids[i, : lengths[i]] for i in rows]).unsqueeze(0),
        "position_ids": torch.cat([positions[i, : lengths[i]] for i in rows]).unsqueeze(0),
        "cu_seqlens": bounds,
    }
    if inputs.get("labels") is not None:
        labels = inputs["labels"]
        row["labels"] = torch.cat([labels[i, : lengths[i]] for i in rows]).unsqueeze(0)
    flags = {key: inputs[key] for key in PASSED if key in inputs}
    return row, flags
