"""Sequence-mixing work: attention's per rank and ring step, read off the layouts' own block
schedules; a recurrent mixer's per token (`MixerShape`, at the end).

The unit is n^2 query-key pairs (n = tokens per rank) for one head: a full n x n block is 1, a
causal (square, diagonal) block 1/2, a zigzag half block (n x n/2) 1/2. Because the planner asks
`ringattn.layout` for the schedule the strategies execute, the causal imbalance of `contiguous`
comes out of the same code that creates it:

    W = 4, causal, work of each rank at each ring step (rank r computes the K/V of rank r - s):

                 contiguous              zigzag / striped
    step 0       .5  .5  .5  .5          .5  .5  .5  .5
    step 1        0   1   1   1          .5  .5  .5  .5
    step 2        0   0   1   1          .5  .5  .5  .5
    step 3        0   0   0   1          .5  .5  .5  .5
    slowest      .5  ... 3.5             2 = the mean

A ring step ends when its slowest rank does (the next K/V come from the neighbour), so the ring's
forward costs the sum over steps of the per-step maximum; the all-gather strategy costs the
slowest rank's total; Ulysses computes every (rank, source) pair for its share of the heads, so
its work is the total divided by W whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ringattn.layout import get_layout

__all__ = [
    "HEAD_PARALLEL_FAMILIES",
    "MIXER_CHOICES",
    "MIXER_KINDS",
    "MIXER_SCHEMES",
    "MixerShape",
    "MixerWork",
    "StepWork",
    "allgather_work",
    "group_ring_steps",
    "mixer_work",
    "resolve_mixer_scheme",
]

_N = 4096  # local length used to read the schedules (any even length gives the same fractions)


@dataclass(frozen=True)
class StepWork:
    """Work of one ring step on its slowest rank: `full` and `causal` area in units of n^2 per
    head (causal area counted as visible pairs), and `block`: key rows per block call / n."""

    full: float
    causal: float
    block: float
    calls: int

    @property
    def area(self) -> float:
        return self.full + self.causal


def _pair(layout: str, rank: int, src: int, world_size: int) -> StepWork:
    full = causal = 0.0
    block, calls = 0.0, 0
    for b in get_layout(layout).schedule(rank, src, world_size, _N, True):
        pairs = (b.q_stop - b.q_start) * (b.kv_stop - b.kv_start) / _N**2
        if b.causal:
            causal += pairs / 2
        else:
            full += pairs
        block = max(block, (b.kv_stop - b.kv_start) / _N)
        calls += 1
    return StepWork(full, causal, block, calls)


def _add(a: StepWork, b: StepWork) -> StepWork:
    return StepWork(a.full + b.full, a.causal + b.causal, max(a.block, b.block), a.calls + b.calls)


@lru_cache(maxsize=512)
def group_ring_steps(layout: str, world_size: int, group: int) -> tuple[StepWork, ...]:
    """Per ring step, the slowest group's work, for a ring of world_size / group groups whose
    `group` ranks pool their tokens (hybrid: Ulysses inside a group; group = 1 is the plain ring,
    group = world_size is Ulysses). Areas are per head of the group's head share, in units of
    n^2 where n is one position's tokens (a group holds group * n tokens)."""
    rings = world_size // group
    steps = []
    for s in range(rings):
        slowest = StepWork(0.0, 0.0, 0.0, 0)
        for g in range(rings):
            src_group = (g - s) % rings
            work = StepWork(0.0, 0.0, 0.0, 0)
            for u in range(group):
                for v in range(group):
                    work = _add(work, _pair(layout, g * group + u, src_group * group + v,
                                            world_size))  # fmt: skip
            if work.area > slowest.area:
                slowest = work
        steps.append(slowest)
    return tuple(steps)


@lru_cache(maxsize=512)
def allgather_work(layout: str, world_size: int) -> StepWork:
    """The slowest rank's work against all gathered K/V shards."""
    totals = []
    for r in range(world_size):
        work = StepWork(0.0, 0.0, 0.0, 0)
        for src in range(world_size):
            work = _add(work, _pair(layout, r, src, world_size))
        totals.append(work)
    return max(totals, key=lambda w: w.area)


MIXER_KINDS = ("gated_deltanet", "mamba2", "mamba1", "short_conv")
HEAD_PARALLEL_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                          "qwen3_5_moe_text", "nemotron_h")  # fmt: skip
"""Config model_types whose mixer the library splits by heads (the classes of
integrations/hf/mixers/heads.py's SPLITS: Qwen3-Next, Qwen3.5, Qwen3.5-MoE gated DeltaNet by key
heads; Nemotron-H's Mamba2 by groups of heads)."""


@dataclass(frozen=True)
class MixerShape:
    """Shape of a recurrent mixer layer. Its state per sequence is heads x state_dim x head_dim
    float32 (S_t = A_t S_{t-1} + B_t, DESIGN.md §13); counts are per token, forward.

        kind            heads          head_dim   state_dim   groups (B/C or key heads)
        gated_deltanet  value heads    dv         dk          key heads (q, k repeated)
        mamba2          heads          P          N           n_groups
        mamba1          d_inner        1          N           -
        short_conv      hidden size    1          0           -
    """

    kind: str
    heads: int
    head_dim: int
    state_dim: int
    groups: int = 0
    conv_kernel: int = 4
    chunk: int = 64
    """Chunk length C of the chunked kernel (fla's 64 for the delta rule, chunk_size for SSD)."""
    dt_rank: int = 0
    """mamba1: rank of the time-step projection."""
    head_parallel: bool = False
    """The library runs this family's layer head-parallel when cp divides the key heads (Mamba2:
    the groups) (HEAD_PARALLEL_FAMILIES); the `heads` scheme is then what `auto` prices."""

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the depthwise causal convolution."""
        if self.kind == "gated_deltanet":  # q, k, v
            return 2 * self.groups * self.state_dim + self.inner
        if self.kind == "mamba2":  # x, B, C
            return self.inner + 2 * self.groups * self.state_dim
        return self.inner

    def matmul_params(self, dim: int) -> int:
        """Projection weights: in (and the small ones), out."""
        if self.kind == "gated_deltanet":  # in_proj_qkvz, in_proj_ba, out_proj
            key = self.groups * self.state_dim
            return dim * (2 * key + 2 * self.inner + 2 * self.heads) + self.inner * dim
        if self.kind == "mamba2":  # in_proj (z, x, B, C, dt), out_proj
            return dim * (self.inner + self.conv_channels + self.heads) + self.inner * dim
        if self.kind == "mamba1":  # in_proj (x, z), x_proj (dt, B, C), dt_proj, out_proj
            r = self.dt_rank
            return dim * 2 * self.inner + self.inner * (r + 2 * self.state_dim) + (
                r * self.inner) + self.inner * dim  # fmt: skip
        return dim * 3 * dim + dim * dim  # short_conv: in_proj (B, C, x), out_proj

    def params(self, dim: int) -> int:
        """Matmul weights, the convolution and the per-head/per-channel vectors (A, D, dt bias,
        the gated norm)."""
        small = {"gated_deltanet": 2 * self.heads + self.head_dim,
                 "mamba2": 3 * self.heads + self.inner,
                 "mamba1": self.inner * (self.state_dim + 2) + self.dt_rank + 2 * self.state_dim,
                 "short_conv": 0}[self.kind]  # fmt: skip
        return self.matmul_params(dim) + self.conv_kernel * self.conv_channels + small

    def recurrence_flops(self) -> float:
        """The sequence mixing itself (not the projections, not the convolution), chunk C:

        gated_deltanet  per value head 6 C dk + 4 C dv (the chunk's k k^T, its W and U, the
                        intra-chunk q k^T and its product with the new values) + 6 dk dv (u - w S,
                        the state update, q S) + 2 C^2 / 3 (the chunk's triangular solve)
        mamba2 (SSD)    2 C N per group (C B^T) + per head 2 C P (the masked product with x)
                        + 4 N P (the chunk state B^T x and the output C S)
        mamba1          9 d_inner N (the selective scan, the count mamba's own benchmark uses)
        """
        c, dk, dv = self.chunk, self.state_dim, self.head_dim
        if self.kind == "gated_deltanet":
            return self.heads * (6 * c * dk + 4 * c * dv + 6 * dk * dv + 2 * c * c / 3)
        if self.kind == "mamba2":
            return self.groups * 2 * c * dk + self.heads * (2 * c * dv + 4 * dk * dv)
        if self.kind == "mamba1":
            return 9 * self.inner * dk
        return 0.0

    def flops(self, dim: int) -> float:
        """Forward FLOPs per token: projections, convolution, recurrence."""
        conv = 2 * self.conv_kernel * self.conv_channels
        return 2 * self.matmul_params(dim) + conv + self.recurrence_flops()

    def state_bytes(self) -> int:
        """The recurrent state of one sequence, float32."""
        return 4 * self.heads * self.state_dim * self.head_dim

    def summary_bytes(self) -> int:
        """What state passing exchanges per run: the state and the run's transition A_run
        (a dk x dk matrix per head for the delta rule, a scalar decay per head for SSD, one per
        channel and state for mamba1), float32."""
        transition = {"gated_deltanet": self.heads * self.state_dim**2,
                      "mamba2": self.heads, "mamba1": self.inner * self.state_dim,
                      "short_conv": 0}[self.kind]  # fmt: skip
        return self.state_bytes() + 4 * transition

    def activation_elems(self, dim: int) -> int:
        """Elements autograd keeps per token inside the mixer (the input norm is the block's):
        the projections' outputs, the convolution's output, the recurrence's output and its
        gated norm (gated_deltanet also the normalised q, k and the gates g, beta)."""
        cc, inner = self.conv_channels, self.inner
        if self.kind == "gated_deltanet":
            return 2 * cc + 3 * inner + 2 * self.groups * self.state_dim + 2 * self.heads
        if self.kind == "mamba2":
            return inner + cc + self.heads + cc + 2 * inner
        if self.kind == "mamba1":
            return 5 * inner + self.dt_rank + 2 * self.state_dim
        return 6 * dim


MIXER_SCHEMES = ("gather", "heads", "state_passing")
"""How a mixer layer runs under CP (DESIGN.md §13-14), per layer and rank, X = S x hidden bytes:

    gather          ("whole" in ringattn.hf.parallelize) all-gather the layer's input, run the
                    whole mixer on the full sequence on every rank (its compute replicated W
                    times), keep this rank's rows; backward reduce-scatters the input gradient:
                    (W-1)/W X forward, (W-1)/W X backward (integrations/hf/mixers/hooks.py's
                    count, 2 (W-1)/W X per call). Bytes grow with S.
    heads           gated DeltaNet split by key heads, Nemotron-H's Mamba2 by groups
                    (integrations/hf/mixers/heads.py): all-gather the input, run the whole
                    sequence for 1/W of the heads (compute 1/W of one process's), reduce-scatter
                    the partial outputs; backward an all-gather and a reduce-scatter: 2 (W-1)/W X
                    each way (the library's 4 (W-1)/W X). Needs W to divide the key heads.
    state_passing   ("state") each rank runs its runs of tokens once (zigzag: 2, else 1) from
                    a zero state, which gives each run's summary (final state + transition:
                    the delta rule carries it in K extra value columns), all-gathers the
                    summaries over W, folds them, and adds the entering state's contribution to
                    each token's output (integrations/hf/mixers/state.py); a conv halo of K - 1
                    tokens per run from the previous run's owner. Bytes flat in S. Striped runs
                    are single tokens: an all-to-all lays the tokens out as runs and back.
"""
MIXER_CHOICES = ("auto", *MIXER_SCHEMES, "state", "whole")
"""--mixer-scheme: `auto` is what the library runs (state passing for every kind it has a
program for, STATE_KINDS; else heads where it splits the layer; else gather); `state` and
`whole` are the library's names (ringattn.hf.parallelize's mixer_scheme) for state_passing and
gather."""
ALIASES = {"state": "state_passing", "whole": "gather"}
STATE_KINDS = ("gated_deltanet", "mamba2", "short_conv")
"""Mixer kinds the library runs by state passing (integrations/hf/mixers/state.py's PROGRAMS)."""
LIBRARY_NAMES = {"state_passing": "state", "gather": "whole", "heads": "heads"}


def _splits(shape: MixerShape, world_size: int, tp: int) -> bool:
    """True when the layer's key heads (Mamba2: its groups), per tp rank, split evenly over
    world_size ranks."""
    if shape.kind not in ("gated_deltanet", "mamba2") or not shape.groups:
        return False
    if shape.heads % shape.groups:
        return False
    return (shape.groups // tp) % world_size == 0


def resolve_mixer_scheme(shape: MixerShape | None, scheme: str, world_size: int,
                         tp: int = 1) -> str:  # fmt: skip
    """The scheme (MIXER_SCHEMES) a mixer layer of `shape` is priced under for `scheme`
    (MIXER_CHOICES): `auto` -> state_passing for the kinds the library passes states for, else
    heads when the library splits the layer (shape.head_parallel and W divides the key heads),
    else gather. ValueError for `heads` where the heads do not split. state_passing for a kind
    the library has no program for is a what-if (train_command notes it)."""
    if scheme not in MIXER_CHOICES:
        raise ValueError(f"unknown mixer scheme {scheme!r}; choose one of "
                         f"{', '.join(MIXER_CHOICES)}")  # fmt: skip
    scheme = ALIASES.get(scheme, scheme)
    if shape is None:
        return scheme
    if scheme == "auto":
        if shape.kind in STATE_KINDS:
            return "state_passing"
        library = world_size > 1 and shape.head_parallel and _splits(shape, world_size, tp)
        return "heads" if library else "gather"
    if scheme == "heads" and not _splits(shape, world_size, tp):
        if shape.kind not in ("gated_deltanet", "mamba2"):
            raise ValueError(f"the heads mixer scheme splits gated_deltanet and mamba2 layers, not "
                             f"{shape.kind}; use auto, gather or state_passing")  # fmt: skip
        raise ValueError(f"the heads mixer scheme needs cp={world_size} to divide the "
                         f"{shape.groups // tp} key heads (Mamba2: groups) per tp rank; pick "
                         f"cp among their divisors, or use auto")  # fmt: skip
    return scheme


@dataclass(frozen=True)
class MixerWork:
    """One mixer layer on one rank, one microbatch: forward work (backward priced from it) and
    the bytes it sends forward and backward, with their dependent message counts."""

    rows: int
    """Tokens the mixer runs on (S per sequence under gather and heads, S / W under state
    passing)."""
    matmul_flops: float
    recurrence_flops: float
    elementwise_elems: float
    """Elements read and written once by the memory-bound passes (conv, gates, norms)."""
    sent: tuple[float, float]
    messages: tuple[int, int]


def mixer_work(shape: MixerShape, scheme: str, layout: str, dim: int, seq_len: int, batch: int,
               world_size: int, tp: int = 1, elem_bytes: int = 2) -> MixerWork:  # fmt: skip
    """The work and traffic of one mixer layer under `scheme` (MIXER_SCHEMES), heads split by tp."""
    if scheme not in MIXER_SCHEMES:
        raise ValueError(f"unknown mixer scheme {scheme!r}; choose one of "
                         f"{', '.join(MIXER_SCHEMES)}")  # fmt: skip
    if shape.heads % tp or shape.groups % tp:
        raise ValueError(f"{shape.kind}: {shape.heads} heads / {shape.groups} groups are not "
                         f"divisible by tp={tp}")  # fmt: skip
    w, n = world_size, seq_len // world_size
    whole = scheme in ("gather", "heads") and w > 1  # the mixer runs on all S rows
    rows = batch * (seq_len if whole else n)
    split = tp * (w if scheme == "heads" else 1)  # heads: 1/W of the heads on each rank
    matmul = 2 * rows * shape.matmul_params(dim) / split
    recurrence = rows * shape.recurrence_flops() / split
    passes = rows * (2 * shape.conv_channels + 6 * shape.inner) / split
    local_input = batch * n * dim / tp * elem_bytes  # (W-1) of them: (W-1)/W of S x hidden
    if w == 1:
        return MixerWork(rows, matmul, recurrence, passes, (0.0, 0.0), (0, 0))
    if scheme == "gather":  # all-gather in; backward a reduce-scatter of the input gradient
        return MixerWork(rows, matmul, recurrence, passes,
                         ((w - 1) * local_input, (w - 1) * local_input),
                         (w - 1, w - 1))  # fmt: skip
    if scheme == "heads":  # + a reduce-scatter of the output forward, an all-gather backward
        resolve_mixer_scheme(shape, scheme, w, tp)
        return MixerWork(rows, matmul, recurrence, passes,
                         (2 * (w - 1) * local_input, 2 * (w - 1) * local_input),
                         (2 * (w - 1), 2 * (w - 1)))  # fmt: skip
    runs = 2 if layout == "zigzag" else 1
    if shape.kind == "gated_deltanet":  # K extra value columns carry the run's transition
        recurrence *= 1 + shape.state_dim / shape.head_dim
    elif shape.kind in ("mamba2", "mamba1"):  # the entering state read once more per token
        recurrence += rows * 2 * shape.heads * shape.head_dim * shape.state_dim / tp
    summary = runs * batch * shape.summary_bytes() / tp
    halo = runs * batch * (shape.conv_kernel - 1) * shape.conv_channels / tp * elem_bytes
    sent = (w - 1) * summary + halo
    messages = (w - 1 if summary else 0) + runs
    if layout == "striped":  # lay the tokens out as runs and back
        sent += 2 * (w - 1) / w * local_input
        messages += 2 * (w - 1)
    return MixerWork(rows, matmul, recurrence, passes, (sent, sent), (messages, messages))
