"""Training data: a long-range retrieval task and byte-level text, sharded by the CP layout.

Every sample is a pure function of (seed, sample index), so the data position of a run is just
its step: a resumed run reads exactly the samples the uninterrupted run would have read, and so
does a run with a different number of CP ranks.

Retrieval task ("key-value"). Byte tokens; `render` prints them readably:

    qmwe{C=7}pgs ezk ..{A=0}.. ufhq{C=7}.. tyo{K=3}kd ..{C=2}.. ..  ?C7?A0?K3
    |<-- filler (a-z, space), every key written `copies` times -->|<-- queries -->|

A record {K=v} is ONE token (byte 128 + 10*key + value; keys A..L, values 0..9). Each of the
`n_keys` keys of a sample is written `copies` times at random places; `noisy` of its copies carry a
wrong value, so its answer is the value of the strict majority of its copies. The sequence ends
with queries `?KEY ANSWER`; only the ANSWER of each query is supervised (every other label is
IGNORE), so the loss starts near ln(10) and falls only when the model finds, from the query at the
end, the records of that key wherever they are in the sequence: on every rank. With `noisy` > 0 no
single copy gives the answer and the model has to count over the whole context.

Why one token per record: a single attention layer can then do the look-up (match the key, read
the value), which a small model learns in a few hundred CPU steps when each key has several
copies. A key followed by a value token needs an induction circuit over two layers, which takes
far longer to form from scratch at these lengths. The point of the task is the range, not depth.

With zigzag CP the queries sit on rank 0 (which holds the last chunk) and the records on every
rank, so the number of supervised tokens per rank is very unequal: which is why the loss is the
mean over all supervised tokens of the global batch, never a mean of per-rank means.

Text ("text:PATH"). The bytes of a file (or of every file in a directory, sorted, concatenated);
sample i is the window at a seeded random offset; every next byte is supervised.

Labels are shifted on the GLOBAL sequence (label[t] = token[t + 1]) before sharding, so inputs,
labels and positions taken with the same group and layout agree on every rank.

From samples to one rank's batch (`Loader`, built once per run):

    step --global_batch--> (B, S) inputs, labels of this rank's dp row
         --shard_batch---> Batch: inputs, labels (B, S/cp), positions (S/cp,) of this cp rank

Sharding uses only the public API (`ringattn.shard`, `ringattn.positions`, the layout by name),
exactly as a user's own data pipeline would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import ringattn
from ringattn.models.loss import IGNORE  # re-exported: the data's labels use it
from ringattn.planner.dynamic_cp.documents import PREFIX as DOCS
from ringattn.planner.dynamic_cp.documents import parse_documents

__all__ = [
    "IGNORE",
    "Batch",
    "KeyValueTask",
    "Loader",
    "TextData",
    "get_dataset",
    "global_batch",
    "render",
    "shard_batch",
]


# samples are made on the host (seeded CPU generators) and moved to the device by the Loader
_FILLER = torch.tensor(list(b"abcdefghijklmnopqrstuvwxyz "), dtype=torch.int64, device="cpu")
_QUERY = ord("?")
N_KEYS, N_VALUES = 12, 10  # keys A..L, values 0..9
_RECORD = 128  # record token of (key k, value v): 128 + N_VALUES * k + v, bytes 128..247


def _generator(seed: int, index: int) -> torch.Generator:
    # distinct, reproducible streams per sample: the index is mixed into the seed
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))


def render(tokens: torch.Tensor | list[int]) -> str:
    """Text of byte tokens, with each record token written as {K=v}."""
    out = []
    for t in tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens:
        if _RECORD <= t < _RECORD + N_KEYS * N_VALUES:
            key, value = divmod(t - _RECORD, N_VALUES)
            out.append(f"{{{chr(ord('A') + key)}={value}}}")
        else:
            out.append(chr(t) if 32 <= t < 127 or t == 10 else f"\\x{t:02x}")
    return "".join(out)


@dataclass(frozen=True)
class KeyValueTask:
    """`n_keys` keys, each written `copies` times over `seq_len` tokens, all queried at the end."""

    seq_len: int
    n_keys: int = N_KEYS
    copies: int = 8
    noisy: int = 0
    """Copies of each key that carry a wrong value; the answer is the value of the majority."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.n_keys <= N_KEYS:
            raise ValueError(f"n_keys must be in 1..{N_KEYS}, got {self.n_keys}")
        if self.copies < 1:
            raise ValueError(f"copies must be >= 1, got {self.copies}")
        if not 0 <= 2 * self.noisy < self.copies:
            raise ValueError(
                f"noisy copies ({self.noisy}) must be fewer than half of the "
                f"{self.copies} copies, so that the answer is a strict majority"
            )
        need = 2 * (3 * self.n_keys + self.n_keys * self.copies)
        if self.seq_len < need:
            raise ValueError(
                f"seq_len {self.seq_len} is too short for {self.n_keys} keys x "
                f"{self.copies} copies and their queries; use at least "
                f"{need} or fewer copies"
            )

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (seq_len,) int64, of sample `index`."""
        gen = _generator(self.seed, index)
        seq = _FILLER[torch.randint(len(_FILLER), (self.seq_len + 1,), generator=gen, device="cpu")]
        keys = torch.randperm(N_KEYS, generator=gen, device="cpu")[: self.n_keys]
        answer = torch.randint(N_VALUES, (self.n_keys,), generator=gen, device="cpu")
        # each key: its answer in all but `noisy` of its copies, any other value in those
        values = answer[:, None].repeat(1, self.copies)  # (n_keys, copies)
        shift = torch.randint(1, N_VALUES, (self.n_keys, self.noisy), generator=gen, device="cpu")
        values[:, : self.noisy] = (answer[:, None] + shift) % N_VALUES  # never the answer
        records = _RECORD + N_VALUES * keys[:, None] + values  # (n_keys, copies)
        query_start = self.seq_len + 1 - 3 * self.n_keys
        where = torch.randperm(query_start, generator=gen, device="cpu")[: records.numel()]
        seq[where] = records.flatten()
        asked = torch.randperm(
            self.n_keys, generator=gen, device="cpu"
        )  # every key, in a random order
        query = [torch.full_like(asked, _QUERY), ord("A") + keys[asked], ord("0") + answer[asked]]
        seq[query_start:] = torch.stack(query, 1).flatten()  # ?C7?A0?K3...
        labels = torch.full((self.seq_len,), IGNORE, dtype=torch.int64, device="cpu")
        at = (
            query_start + 3 * torch.arange(self.n_keys, device="cpu") + 1
        )  # input KEY -> label its answer
        labels[at] = seq[at + 1]
        return seq[:-1], labels


@dataclass(frozen=True)
class TextData:
    """Byte-level windows of `seq_len` tokens from a file or a directory of files."""

    path: str
    seq_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bytes", _read_bytes(self.path))
        if len(self._bytes) < self.seq_len + 1:
            raise ValueError(
                f"{self.path} holds {len(self._bytes)} bytes, fewer than seq_len + 1 "
                f"= {self.seq_len + 1}; use a shorter --seq-len or more text"
            )

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = _generator(self.seed, index)
        start = int(
            torch.randint(len(self._bytes) - self.seq_len, (1,), generator=gen, device="cpu")
        )
        window = self._bytes[start : start + self.seq_len + 1].to(torch.int64)
        return window[:-1], window[1:]


def _read_bytes(path: str) -> torch.Tensor:
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"text data {path!r} is neither a file nor a directory")
    parts = []
    for name in files:
        with open(name, "rb") as f:
            parts.append(f.read())
    data = b"\n".join(parts)
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, device="cpu")
    )


def get_dataset(
    name: str, seq_len: int, seed: int, keys: int = N_KEYS, copies: int = 8, noisy: int = 0
):
    """`key-value` (the retrieval task), `text:PATH` (bytes of a file or directory) or
    `docs:MEAN,SIGMA,MIN,MAX` (packed documents: planner/dynamic_cp/documents.py)."""
    if name == "key-value":
        return KeyValueTask(seq_len, keys, copies, noisy, seed)
    if name.startswith(DOCS):
        return parse_documents(name, seq_len, seed)
    if name.startswith("text:"):
        return TextData(name[len("text:") :], seq_len, seed)
    raise ValueError(
        f"unknown data {name!r}; choose from key-value, text:PATH, docs:MEAN,SIGMA,MIN,MAX"
    )


@dataclass
class Batch:
    """One rank's shard: inputs and labels (B, S_local), positions (S_local,) global indices."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor


def global_batch(dataset, step: int, batch_size: int, dp_rank: int, dp_size: int):
    """Full-length (inputs, labels), each (batch_size, S), of data-parallel rank `dp_rank` at
    `step`: samples step*B*dp + dp_rank*B + i for i < B (B = batch_size per dp rank)."""
    first = (step * dp_size + dp_rank) * batch_size
    pairs = [dataset.sample(first + i) for i in range(batch_size)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])  # (B, S)


def shard_batch(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    group: object,
    layout: str,
    device: torch.device | str = "cpu",
) -> Batch:
    """This CP rank's part of full (B, S) inputs and labels, with matching global positions."""
    seq_len = inputs.shape[1]
    return Batch(
        ringattn.shard(inputs, 1, group=group, layout=layout).to(device),  # (B, S/W)
        ringattn.shard(labels, 1, group=group, layout=layout).to(device),  # (B, S/W)
        ringattn.positions(seq_len, group=group, layout=layout, device=device),  # (S/W,)
    )


@dataclass(frozen=True)
class Loader:
    """The batches of one rank: `batch(step)` is its shard of its dp row's samples at `step`.

    `group` is the rank's cp group (a process group or DeviceMesh; None for one process). A pure
    function of the step, so resuming at step N needs no data state beyond N.
    """

    dataset: object
    batch_size: int
    dp_rank: int
    dp: int
    group: object
    layout: str
    device: torch.device

    def full(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full-length (inputs, labels), each (batch_size, S), before sharding."""
        return global_batch(self.dataset, step, self.batch_size, self.dp_rank, self.dp)

    def batch(self, step: int) -> Batch:
        return shard_batch(*self.full(step), self.group, self.layout, self.device)
