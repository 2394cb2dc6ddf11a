"""Which layers a tiny config keeps: the shortest prefix that shows every kind of layer.

Step 1 of tiny_hf.py's shrinking. Each layer gets a signature: its entry in every per-layer list
(a list of length num_hidden_layers, or a pattern string), whether it is in every layer-index
list (increasing ints below that count) and every dict keyed by layer index (Gemma 4's
`per_layer_config`: "05", "11", ...), and where it falls in every period (jamba's
`attn_layer_period`/`_offset`, `decoder_sparse_step`, `first_k_dense_replace`...). The kept
layers are the shortest prefix that shows every signature (at least 2 layers: layers compose),
or one layer of each signature beyond MAX_LAYERS, and the lists and dicts are re-indexed to them.

    layer_types  [s s s s s F s s s s s F ...]  (30)   ->  [s s s s s F]    (6)
    per_layer_config {"05": .., "11": .., ...}          ->  {"05": ..}
    encoder_layers 12, decoder_layers 12                ->  6, 6            (every other count)
"""

from __future__ import annotations

import re
from collections.abc import Callable

MAX_LAYERS = 8

# the count that per-layer lists follow, the first present in this order
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers",
                "num_decoder_layers", "depth")  # fmt: skip
# other layer counts (an encoder's): cut to the kept count too
_OTHER_COUNTS = ("encoder_layers", "num_encoder_layers")
_LAYER_LISTS = ("layer_types", "layers_block_type", "hybrid_override_pattern")


def _periods(d: dict) -> list[Callable[[int], bool]]:
    periods = []
    for name, value in d.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            continue
        if name.endswith("_period"):
            offset = d.get(name.removesuffix("_period") + "_offset", 0) or 0
            periods.append(lambda i, p=value, o=offset: i % p == o % p)
        elif name.endswith(("_step", "_interval", "_freq")):
            periods.append(lambda i, p=value: (i + 1) % p == 0)
    if isinstance(d.get("first_k_dense_replace"), int):
        periods.append(lambda i, k=d["first_k_dense_replace"]: i >= k)
    return periods


def layer_keys(value: object, count: int) -> list[int]:
    """A dict keyed by layer index (ints, or digit strings such as "05"): its indices; else []."""
    if not isinstance(value, dict) or not value:
        return []
    keys = [k if isinstance(k, int) else int(k) if isinstance(k, str) and k.isdigit() else -1
            for k in value]  # fmt: skip
    return keys if all(0 <= k < count for k in keys) else []


def _like(key: object, index: int) -> object:
    """`index` as a key of the same form as `key` (an int, or a string of the same width)."""
    return index if isinstance(key, int) else str(index).zfill(len(key))


def _classify(d: dict, count: int, key: str | None) -> tuple[list[str], list[str], list[str]]:
    """The names of (per-layer lists, layer-index lists, dicts keyed by layer index)."""
    per_layer, indexed, keyed = [], [], []
    for name, value in d.items():
        if isinstance(value, (list, str)) and len(value) == count and name != key:
            if isinstance(value, str) and "pattern" not in name:
                continue  # a string of that length by chance, not a per-layer pattern
            items = list(value)
            if all(isinstance(x, int) for x in items) and items == sorted(set(items)):
                indexed.append(name)  # 0..count-1: an index list and a per-layer list alike
            else:
                per_layer.append(name)
        elif (isinstance(value, list) and value and all(isinstance(x, int) for x in value)
              and value == sorted(set(value)) and value[-1] < count
              and re.search(r"layer|idx|indices|ids|indexes", name)):  # fmt: skip
            indexed.append(name)
        elif (isinstance(value, dict) and "layer" in name and "model_type" not in value
              and layer_keys(value, count)):  # fmt: skip
            keyed.append(name)  # per_layer_config; never a sub-config or id2label
    return per_layer, indexed, keyed


def keep_layers(d: dict, shrink_entry: Callable[[dict], None]) -> None:
    """Cut the layers of config dict `d` in place (module docstring); `shrink_entry` shrinks the
    dict values of a dict keyed by layer (a layer's own overrides of widths)."""
    key = next((k for k in LAYER_COUNTS if isinstance(d.get(k), int)), None)
    if key is not None:
        count = d[key]
    else:  # Nemotron-H: the count is a property, the length of its layer list
        lists = [d[k] for k in _LAYER_LISTS if isinstance(d.get(k), (list, str))]
        if not lists:
            return
        count = len(lists[0])
    per_layer, indexed, keyed = _classify(d, count, key)
    sets = [set(d[name]) for name in indexed] + [set(layer_keys(d[n], count)) for n in keyed]
    periods = _periods(d)
    signatures = [
        (tuple(repr(d[name][i]) for name in per_layer), tuple(i in s for s in sets),
         tuple(f(i) for f in periods))
        for i in range(count)
    ]  # fmt: skip
    first_seen = sorted({s: i for i, s in reversed(list(enumerate(signatures)))}.values())
    prefix = max(first_seen[-1] + 1 if first_seen else 1, min(2, count))  # 2: layers compose
    keep = list(range(prefix)) if prefix <= MAX_LAYERS else first_seen
    for name in (*LAYER_COUNTS, *_OTHER_COUNTS):
        if isinstance(d.get(name), int) and not isinstance(d[name], bool) and d[name] > 0:
            d[name] = len(keep) if name == key else min(d[name], len(keep))
    for name in per_layer:
        kept = [d[name][i] for i in keep]
        d[name] = "".join(kept) if isinstance(d[name], str) else kept
    for name in indexed:
        d[name] = [keep.index(i) for i in d[name] if i in keep]
    for name in keyed:
        entries = {}
        for k, i in zip(d[name], layer_keys(d[name], count)):
            if i in keep:
                if isinstance(d[name][k], dict):
                    shrink_entry(d[name][k])
                entries[_like(k, keep.index(i))] = d[name][k]
        d[name] = entries
