"""`shard_batch`: one full (1, S) training sequence -> this rank's keyword arguments for the model.

Every rank passes the same full batch and gets back its own tokens in the layout's order:

    full sequence, 2 documents        a0 a1 a2 a3 a4 | b0 b1 b2          (S = 8, W = 2, zigzag)
    labels shifted globally           a1 a2 a3 a4 -  | b1 b2 -           (- = -100: never predict
                                                                          across a document end)
    rank 0 holds                      a0 a1 p  p  | b1 b2                (p: padding, packing.py)
    rank 1 holds                      a2 a3 a4 p  | b0 p

1. Documents. `cu_seqlens` if given; else documents start wherever `position_ids` do not go up by
   one (what DataCollatorWithFlattening produces: positions restarting at 0); else one document.
   The bounds travel to the attention function as `cu_seq_lens_q`/`cu_seq_lens_k` (transformers'
   own keyword names for cumulative sequence lengths), here over the *global* sequence.
2. Tokens. `ringattn.positions(S, cu_seqlens=...)` gives the global index of each local row (-1 for
   padding, which lets any S work); input_ids, position_ids and labels are gathered by it. Padding
   rows get token 0, position 0 and label -100: never attended to, never supervised.
3. Positions. The global position_ids (the user's, or 0..S-1, or restarting per document when only
   cu_seqlens is given) so that RoPE sees each token's true position.
4. Labels. Shifted on the global sequence *before* sharding (label of token t = labels[t + 1]), so
   a shard's last token predicts the next shard's first; the last token of every document gets
   -100. They go in as both `labels` and `shift_labels` (transformers' causal-LM loss then does not
   shift again) with `num_items_in_batch`, the supervised-token count of the whole sequence: the
   loss is this rank's sum of token losses over that count, so the sum over ranks is the
   single-device mean and the summed gradients are the single-device gradients.
5. Images and videos (`pixel_values`, `image_grid_thw`, `mm_token_type_ids`, ...: vision.py).
   input_ids, the pixels and the token types stay whole (the model merges the image embeddings
   and numbers the 3-D positions on the whole sequence; a pre-hook on its text decoder cuts
   them); only the labels are sharded as above.
6. Agreement. The ranks compare a digest of what they were given (agreement.py): one small
   all-gather per call, ValueError on every rank when one was given another sequence.
"""

from __future__ import annotations

import itertools

import torch

import ringattn
from ringattn.integrations.hf.agreement import check_same_batch
from ringattn.integrations.hf.vision import MULTIMODAL_KEYS
from ringattn.packing import check_cu_seqlens

IGNORE = -100
_KEYS = (
    "input_ids",
    "labels",
    "position_ids",
    "cu_seqlens",
    "attention_mask",
    "num_items_in_batch",
    *MULTIMODAL_KEYS,
)


def _check_tokens(name: str, x: object, seq_len: int | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"shard_batch takes one full sequence: {name} must be a (1, S) tensor, got {shape}; "
            f"pack a batch of several sequences into one row (documents, with position_ids or "
            f"cu_seqlens)"
        )
    if seq_len is not None and x.shape[1] != seq_len:
        raise ValueError(f"{name} has {x.shape[1]} tokens but input_ids has {seq_len}")
    return x


def _documents(position_ids: torch.Tensor | None, cu_seqlens: object, seq_len: int) -> list[int]:
    """Document bounds [0, ..., S] from cu_seqlens, or from position_ids, or the whole sequence."""
    if cu_seqlens is not None:
        bounds = list(check_cu_seqlens(cu_seqlens))
        if bounds[-1] != seq_len:
            raise ValueError(
                f"cu_seqlens ends at {bounds[-1]} but the sequence has {seq_len} tokens; "
                f"cu_seqlens[-1] must be the total length"
            )
        return bounds
    if position_ids is None or position_ids.dim() != 2:  # 3-D M-RoPE positions: never packing
        return [0, seq_len]
    pos = position_ids[0].to("cpu", torch.int64)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
    return [0, *starts.tolist(), seq_len]


def _default_positions(bounds: list[int], per_document: bool, device: torch.device) -> torch.Tensor:
    """(1, S) positions 0..S-1, or restarting at 0 in each document."""
    seq_len = bounds[-1]
    if not per_document:
        return torch.arange(seq_len, device=device).unsqueeze(0)
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], device=device)
    starts = torch.repeat_interleave(torch.tensor(bounds[:-1], device=device), lengths)
    return (torch.arange(seq_len, device=device) - starts).unsqueeze(0)


def _take(full: torch.Tensor, index: torch.Tensor, fill: int) -> torch.Tensor:
    """full[..., index] along the last dim, `fill` where index is -1 (padding rows)."""
    index = index.to(full.device)
    taken = full.index_select(-1, index.clamp(min=0))
    return torch.where(index >= 0, taken, torch.full_like(taken, fill))


def shift_labels(labels: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """(1, S) labels -> the label each token predicts: labels[t + 1], -100 at every document end."""
    shifted = torch.full_like(labels, IGNORE)
    shifted[:, :-1] = labels[:, 1:]
    ends = [end - 1 for end in bounds[1:] if end > 0]
    shifted[:, torch.tensor(ends, dtype=torch.int64, device=labels.device)] = IGNORE
    return shifted


def shard_batch(
    batch: dict[str, object], group: object = None, layout: str = "zigzag"
) -> dict[str, object]:
    """This rank's keyword arguments for `model(**...)` of a model prepared with `parallelize`.

    `batch` holds the full (1, S) sequence, the same on every rank of `group` (checked on every
    call: ValueError naming the ranks that differ), any S: `input_ids`, optionally `labels`
    (-100 = unsupervised, unshifted as for transformers), `position_ids` (restarting at 0
    per packed document, or 3-D M-RoPE positions (3, 1, S)), `cu_seqlens` ([0, e1, ..., S]),
    `attention_mask` (all ones only) and `num_items_in_batch` (a global supervised-token count to
    divide by instead of this sequence's, e.g. over data-parallel ranks or accumulation steps).
    A vision-language batch also holds what the processor returns (`pixel_values`,
    `image_grid_thw`, `mm_token_type_ids`, the video equivalents): those and input_ids are then
    returned whole, for the model's own merge (vision.py).
    `group` and `layout` must be those given to `parallelize`. Returns input_ids, position_ids,
    cu_seq_lens_q/k, use_cache=False and, with labels, labels, shift_labels and num_items_in_batch.
    """
    if not isinstance(batch, dict):
        raise TypeError(f"shard_batch takes a dict of tensors, got {type(batch).__name__}")
    unknown = sorted(set(batch) - set(_KEYS))
    if unknown:
        raise ValueError(f"shard_batch does not know the keys {unknown}; it takes {list(_KEYS)}")
    if "input_ids" not in batch:
        raise ValueError("shard_batch needs input_ids, a (1, S) tensor of token ids")
    ids = _check_tokens("input_ids", batch["input_ids"], None)
    seq_len = ids.shape[1]
    mask = batch.get("attention_mask")
    if mask is not None and not bool(_check_tokens("attention_mask", mask, seq_len).all()):
        raise ValueError(
            "the attention_mask has zeros (padding); ringattn.hf takes no dense attention_mask: "
            "drop the padding tokens, or pack the sequences as documents (position_ids that "
            "restart at 0, or cu_seqlens)"
        )
    position_ids = batch.get("position_ids")
    multimodal = [key for key in MULTIMODAL_KEYS if batch.get(key) is not None]
    if multimodal and (position_ids is not None or batch.get("cu_seqlens") is not None):
        raise ValueError(
            f"shard_batch got {multimodal} with position_ids or cu_seqlens: a multimodal batch is "
            f"one sequence whose positions the model computes (3-D M-RoPE); packing several "
            f"multimodal documents is not supported"
        )
    if position_ids is not None:
        multi = isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3
        if multi and position_ids.shape[1:] == (1, seq_len):
            pass
        else:
            _check_tokens("position_ids", position_ids, seq_len)
    bounds = _documents(position_ids, batch.get("cu_seqlens"), seq_len)
    if position_ids is None:
        position_ids = _default_positions(bounds, batch.get("cu_seqlens") is not None, ids.device)
    fields = {"input_ids": ids, "labels": batch.get("labels"), "position_ids": position_ids,
              "cu_seqlens": bounds, **{key: batch.get(key) for key in MULTIMODAL_KEYS}}  # fmt: skip
    check_same_batch(fields, group, ids.device)  # one small all-gather: the same sequence?
    index = ringattn.positions(seq_len, group=group, layout=layout, cu_seqlens=bounds)
    # kept on the CPU: the attention function reads the bounds on the host (a CUDA copy would
    # cost a device sync in every layer)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cpu")
    if multimodal:  # the model merges the images and numbers positions on the whole sequence,
        # and the decoder's pre-hook (vision.py) cuts them into this rank's rows
        local = {"input_ids": ids, **{key: batch[key] for key in multimodal}}
    else:
        local = {"input_ids": _take(ids, index, 0),
                 "position_ids": _take(position_ids.to(ids.device), index, 0)}  # fmt: skip
    local.update({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "use_cache": False})
    labels = batch.get("labels")
    if labels is not None:
        shifted = shift_labels(_check_tokens("labels", labels, seq_len), bounds)
        local["labels"] = local["shift_labels"] = _take(shifted, index, IGNORE)
        count = batch.get("num_items_in_batch")
        if count is None:
            count = (shifted != IGNORE).sum()
        local["num_items_in_batch"] = torch.as_tensor(count, device=ids.device)
    return local
