"""`ringattn bench --million`: an emulated 8-way ring over 1,048,576 causal tokens, checked.

One device holds the whole problem once; the ring's ranks run one at a time, so the ring adds
only one rank's working memory (plus the float32 dK/dV partials of all ranks) on top:

    1. q, k, v, dout (bf16 on a GPU) over all S tokens
    2. monolithic: the cuDNN op (CPU: the CPU flash op) forward + backward over all S tokens,
       through kernels.py's wrapper (the op SDPA's cuDNN backend runs, which also returns lse);
       timed once after a small warm-up; out, lse, dq, dk, dv kept
    3. yardstick: the flash op (CPU: the reference kernel) over all S tokens, compared with the
       monolithic results head-chunk by head-chunk, then freed: how far two single-device bf16
       kernels disagree
    4. fp64 reference on a few sampled query rows per rank (all their keys, in key chunks):
       out, lse, dq; and the plain lse (bf16 scores, float32 logsumexp) of check.py's yardstick
    5. ring, rank by rank: forward share (timed, peak memory), backward share (timed); each rank's
       out, lse, dq compared with the monolithic rows, then freed; finally dk, dv per rank
    6. gates (reference.py's bf16 rule, max <= 2.5x and mean <= 2x the yardstick's error):
       sampled rows vs fp64 — ring out, dq against the monolithic op's error, lse against the
       plain lse's; all rows — ring vs monolithic against yardstick vs monolithic for out, dq, dk,
       dv, or one bf16 rounding step where that is larger (lse is reported: both are float32 and
       differ only in the last bits)

On a CPU the same path runs scaled down (defaults: 4,096 tokens, 2:1 heads) as a dry run of the
GPU script. Times are device-event medians of one run each (rank shares: the first and last
rank run once untimed first, which builds the block shapes' kernels).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from ringattn.bench.common import (
    PeakMemory,
    attention_flops,
    header,
    resolve_device,
    tensor_mb,
    timed,
    write_json,
)
from ringattn.bench.sweep import MERGES
from ringattn.kernels import KERNELS
from ringattn.layout import get_layout
from ringattn.testing import emulated as emulate
from ringattn.testing.yardstick import MAX_RATIO, MEAN_RATIO, Errors, relative_gate

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@dataclass
class MillionConfig:
    """What `ringattn bench --million` runs; None: per-device default (GPU: the 1M run; CPU: a
    scaled-down dry run)."""

    seq_len: int | None = None
    world_size: int = 8
    heads: tuple[int, int] | None = None
    head_dim: int | None = None
    dtype: str = "bfloat16"
    device: str = "auto"
    backend: str = "auto"
    merge: str = "auto"
    sample_rows: int = 8
    """Query rows per rank checked against the fp64 reference."""
    threads: int | None = None
    """CPU threads; default 1 on a CPU (see BenchConfig.threads)."""
    seed: int = 0
    json_path: str | None = None

    def resolve(self, device: torch.device) -> MillionConfig:
        cuda = device.type == "cuda"
        out = MillionConfig(**vars(self))
        out.device = str(device)
        out.seq_len = self.seq_len or (1 << 20 if cuda else 4096)
        out.heads = tuple(self.heads or ((8, 8) if cuda else (2, 1)))
        out.head_dim = self.head_dim or (128 if cuda else 64)
        out.threads = self.threads or (None if cuda else 1)
        get_layout("zigzag").check_seq_len(out.seq_len, out.world_size)
        if out.heads[0] % out.heads[1]:
            raise ValueError(f"heads {out.heads}: query heads must be a multiple of kv heads")
        if out.merge not in MERGES or out.merge == "none":
            raise ValueError(f"--merge {out.merge!r}: the 1M run needs a real merge")
        return out


class Stats:
    """Running max and mean of |a - b| over chunks (float32 differences), and of |b|."""

    def __init__(self) -> None:
        self.max, self.total, self.count, self.finite = 0.0, 0.0, 0, True
        self.ref_max, self.ref_total = 0.0, 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor, heads_per_chunk: int = 4) -> None:
        for h in range(0, a.shape[1], heads_per_chunk):
            x, y = a[:, h : h + heads_per_chunk].float(), b[:, h : h + heads_per_chunk].float()
            self.finite &= bool(torch.isfinite(x).all())
            diff = (x - y).abs()
            self.max = max(self.max, diff.max().item())
            self.total += diff.sum(dtype=torch.float64).item()
            self.count += diff.numel()
            self.ref_max = max(self.ref_max, y.abs().max().item())
            self.ref_total += y.abs().sum(dtype=torch.float64).item()

    def errors(self) -> Errors:
        if not self.finite:
            return Errors(math.inf, math.inf)
        return Errors(self.max, self.total / max(1, self.count))

    def rounding_floor(self, dtype: torch.dtype) -> Errors:
        """Differences no kernel in `dtype` can avoid: one rounding step (eps x |value|) at the
        largest value for the max, a quarter of one on average for the mean."""
        eps = torch.finfo(dtype).eps
        return Errors(eps * self.ref_max, eps / 4 * self.ref_total / max(1, self.count))


def agreement_gate(ring: Stats, yard: Stats, dtype: torch.dtype) -> tuple[bool, float]:
    """The bf16 rule on differences from the monolithic result: within 2.5x max / 2x mean of the
    yardstick kernel's, or within the dtype's rounding floor where that is larger (two kernels
    that both round the same float32 values can agree better than any ring could)."""
    base, floor = yard.errors(), ring.rounding_floor(dtype)
    lifted = Errors(max(base.max, floor.max / MAX_RATIO), max(base.mean, floor.mean / MEAN_RATIO))
    return relative_gate(ring.errors(), lifted)


def sampled_reference(q, k, v, dout, positions, scale, chunk=1 << 16) -> dict[str, torch.Tensor]:
    """fp64 out, lse, dq (and the plain bf16-score lse) of the query rows at global `positions`
    over all their causal keys, two passes over key chunks. q, dout: (B, Hq, S, D)."""
    b, hq = q.shape[:2]
    groups = hq // k.shape[1]
    last = int(positions.max()) + 1
    qs = q.index_select(2, positions)  # (B, Hq, m, D)
    qd, dod = qs.double(), dout.index_select(2, positions).double()

    def chunks():
        for start in range(0, last, chunk):
            stop = min(last, start + chunk)
            kc = k[:, :, start:stop].repeat_interleave(groups, 1)  # (B, Hq, c, D)
            vc = v[:, :, start:stop].repeat_interleave(groups, 1)
            visible = torch.arange(start, stop, device=q.device)[None, :] <= positions[:, None]
            yield kc, vc, visible  # visible: (m, c)

    neg = -math.inf
    lse = torch.full((b, hq, len(positions)), neg, dtype=torch.float64, device=q.device)
    plain = torch.full_like(lse, neg, dtype=torch.float32)
    for kc, _, visible in chunks():
        scores = (qd @ kc.double().transpose(-1, -2) * scale).masked_fill(~visible, neg)
        lse = torch.logaddexp(lse, torch.logsumexp(scores, -1))
        bf = (qs @ kc.transpose(-1, -2)).float() * scale  # the inputs' dtype, as _plain_lse
        plain = torch.logaddexp(plain, torch.logsumexp(bf.masked_fill(~visible, neg), -1))
    out = torch.zeros_like(qd)
    pdp_k = torch.zeros_like(qd)  # sum_j P_ij dP_ij k_j
    p_k = torch.zeros_like(qd)  # sum_j P_ij k_j
    for kc, vc, visible in chunks():
        kd, vd = kc.double(), vc.double()
        scores = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~visible, neg)
        probs = torch.exp(scores - lse.unsqueeze(-1))  # (B, Hq, m, c)
        dprobs = dod @ vd.transpose(-1, -2)
        out += probs @ vd
        pdp_k += (probs * dprobs) @ kd
        p_k += probs @ kd
    delta = (dod * out).sum(-1, keepdim=True)  # D_i = dout_i . out_i
    dq = (pdp_k - delta * p_k) * scale  # sum_j P_ij (dP_ij - D_i) k_j * scale
    return {"out": out, "lse": lse, "dq": dq, "plain_lse": plain}


def run_million(cfg: MillionConfig, argv: list[str] | None = None) -> int:
    device = resolve_device(cfg.device)
    cfg = cfg.resolve(device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    world_size, seq_len, (hq, hkv), d = cfg.world_size, cfg.seq_len, cfg.heads, cfg.head_dim
    dtype, scale = getattr(torch, cfg.dtype), cfg.head_dim**-0.5
    data = header(device, cfg, argv)
    t_start = time.perf_counter()

    def say(text: str) -> None:
        print(f"[million {time.perf_counter() - t_start:6.1f}s] {text}", flush=True)

    say(f"{seq_len} causal tokens, {world_size}-way zigzag ring emulated on {device}; heads "
        f"{hq}:{hkv} x {d}, {cfg.dtype}")  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    shapes = [(1, hq, seq_len, d), (1, hkv, seq_len, d), (1, hkv, seq_len, d), (1, hq, seq_len, d)]
    q, k, v, dout = (torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes)
    # (monolithic, yardstick) kernels; on a GPU flash/efficient stand in if cuDNN fails at this size
    pairs = [("cudnn", "flash"), ("flash", "efficient")] if device.type == "cuda" else [
        ("cpu_flash", "reference")]  # fmt: skip
    for mono_name, yard_name in pairs:
        try:
            want, data["monolithic"] = _monolithic(KERNELS[mono_name], q, k, v, dout, scale)
            break
        except RuntimeError as err:
            say(f"monolithic {mono_name} failed ({str(err).splitlines()[0][:160]}); next")
            data.setdefault("fallbacks", []).append(f"{mono_name}: {err}"[:400])
    else:
        raise RuntimeError("no monolithic kernel ran the full sequence; see the messages above")
    mono = data["monolithic"]
    say(f"monolithic {mono_name}: fwd {mono['fwd_ms']:.0f} ms, bwd {mono['bwd_ms']:.0f} ms")
    yard = _yardstick(KERNELS[yard_name], q, k, v, dout, scale, want)
    say(f"yardstick {yard_name} vs {mono_name} compared")

    layout = get_layout("zigzag")
    shards = emulate.make_shards(layout, world_size, q, k, v, dout)
    picks = torch.linspace(0, seq_len // world_size - 1, cfg.sample_rows, device=device)
    picks = picks.round().long().unique()  # local rows of every rank checked against fp64
    sample_pos = torch.cat([shards.index[r][picks] for r in range(world_size)])
    expected = sampled_reference(q, k, v, dout, sample_pos, scale)
    del q, k, v, dout  # the shards hold the inputs from here on
    _empty_cache(device)
    say(f"fp64 reference on {len(sample_pos)} sampled rows done")

    call = emulate.make_call(layout, world_size, shards.q[0], shards.kv[0, 0], True, cfg.backend)
    ring, got_rows, data["ring"] = _ring(call, shards, want, picks, MERGES[cfg.merge], say)
    data["ring"]["merge"] = cfg.merge

    checks = []
    mono_rows = {name: want[name].index_select(2, sample_pos).double() for name in ("out", "dq")}
    mono_rows["lse"] = expected["plain_lse"].double()  # the lse yardstick: bf16 scores
    for name in ("out", "lse", "dq"):
        ring_err = _errors(got_rows[name], expected[name])
        base_err = _errors(mono_rows[name], expected[name])
        passed, worst = relative_gate(ring_err, base_err)
        yardstick = "plain lse (bf16 scores)" if name == "lse" else mono_name
        checks.append(_check_row(f"{name} (sampled rows vs fp64)", ring_err, base_err, yardstick,
                                 passed, worst))  # fmt: skip
    for name in QUANTITIES:
        ring_err, base_err = ring[name].errors(), yard[name].errors()
        if name == "lse":
            passed, worst = math.isfinite(ring_err.max), None
        else:
            passed, worst = agreement_gate(ring[name], yard[name], dtype)
        what, yardstick = f"{name} (all rows vs {mono_name})", f"{yard_name} vs it"
        checks.append(_check_row(what, ring_err, base_err, yardstick, passed, worst))
    data["checks"], data["passed"] = checks, all(c["passed"] for c in checks)

    ranks = data["ring"]["ranks"]
    ring_fwd = max(r["fwd_ms"] for r in ranks)
    ring_all = max(r["fwd_ms"] + r["bwd_ms"] for r in ranks)
    flops_f = attention_flops(1, hq, seq_len, d, True, False)
    flops_fb = attention_flops(1, hq, seq_len, d, True, True)
    data["ring"].update({
        "efficiency_fwd": (mono["fwd_ms"] / world_size) / ring_fwd,
        "efficiency_fwd_bwd": ((mono["fwd_ms"] + mono["bwd_ms"]) / world_size) / ring_all,
        "tflops_fwd": flops_f / world_size / (ring_fwd * 1e-3) / 1e12,
        "tflops_fwd_bwd": flops_fb / world_size / (ring_all * 1e-3) / 1e12,
        "max_rank_peak_mb": max(r["peak_mb"] for r in ranks),
    })  # fmt: skip
    mono["tflops_fwd"] = flops_f / (mono["fwd_ms"] * 1e-3) / 1e12
    mono["tflops_fwd_bwd"] = flops_fb / ((mono["fwd_ms"] + mono["bwd_ms"]) * 1e-3) / 1e12
    _print_report(data, cfg)
    if cfg.json_path:
        write_json(cfg.json_path, data)
        print(f"wrote {cfg.json_path}")
    return 0 if data["passed"] else 1


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _warm_up(kernel, q, k, v, dout, scale) -> None:
    """First-call costs (library loads, kernel builds) outside the timed region."""
    warm = [x[:, :, :256] for x in (q, k, v, dout)]
    out, lse = kernel.forward(*warm[:3], True, scale)
    kernel.backward(warm[3], *warm[:3], out, lse, True, scale)


def _monolithic(kernel, q, k, v, dout, scale) -> tuple[dict, dict]:
    """The monolithic forward + backward over all tokens, timed once: (results in the inputs'
    dtype, as a user gets them; stats)."""
    device = q.device
    _warm_up(kernel, q, k, v, dout, scale)
    with PeakMemory(device) as peak:
        (out, lse), fwd_ms = timed(kernel.forward, device, q, k, v, True, scale)
        grads, bwd_ms = timed(kernel.backward, device, dout, q, k, v, out, lse, True, scale)
    want = {"lse": lse, **dict(zip(("out", "dq", "dk", "dv"), (out, *grads)))}
    want = {name: x if name == "lse" else x.to(q.dtype) for name, x in want.items()}
    stats = {"kernel": kernel.name, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
             "peak_mb": peak.mb + tensor_mb(q, k, v, dout)}  # fmt: skip
    return want, stats


def _yardstick(kernel, q, k, v, dout, scale, want) -> dict[str, Stats]:
    """How far a second single-device kernel is from the monolithic results (then freed)."""
    _warm_up(kernel, q, k, v, dout, scale)
    yard = {name: Stats() for name in QUANTITIES}
    out, lse = kernel.forward(q, k, v, True, scale)
    for name, got in zip(("dq", "dk", "dv"), kernel.backward(dout, q, k, v, out, lse, True, scale)):
        yard[name].add(got, want[name])
    yard["out"].add(out, want["out"])
    yard["lse"].add(lse, want["lse"])
    del out, lse
    _empty_cache(q.device)
    return yard


def _ring(call, shards, want, picks, merge, say) -> tuple[dict, dict, dict]:
    """Every rank's share, one at a time: timed, peak memory, compared with the monolithic
    results. Returns (Stats per quantity, the sampled rows per quantity, stats)."""
    device, world_size = shards.q.device, shards.world_size
    call = dataclasses.replace(call, merge=merge)
    partials = emulate.new_partials(shards)
    for rank in sorted({0, world_size - 1}):  # warm-up: both extreme block shapes, then reset
        out, lse = emulate.forward_share(call, shards, rank)
        emulate.backward_share(call, shards, rank, out, lse, partials)
    partials.zero_()
    ring = {name: Stats() for name in QUANTITIES}
    rows: dict[str, list] = {"out": [], "lse": [], "dq": []}
    local_mb = tensor_mb(shards.q[0], shards.kv[0], shards.dout[0])
    local_mb += emulate.partial_bytes(shards) / 2**20  # a real rank holds its travelling partial
    ranks = []
    for rank in range(world_size):
        with PeakMemory(device) as peak:
            (out, lse), f_ms = timed(emulate.forward_share, device, call, shards, rank)
            dq, b_ms = timed(emulate.backward_share, device, call, shards, rank, out, lse, partials)
        for name, got in (("out", out), ("lse", lse), ("dq", dq)):
            ring[name].add(got, want[name].index_select(2, shards.index[rank]))
            rows[name].append(got.index_select(2, picks).double())
        ranks.append({"rank": rank, "fwd_ms": f_ms, "bwd_ms": b_ms,
                      "peak_mb": peak.mb + local_mb})  # fmt: skip
        say(f"rank {rank}: fwd {f_ms:.0f} ms, bwd {b_ms:.0f} ms, peak {peak.mb + local_mb:.0f} MB")
        del out, lse, dq
    for rank in range(world_size):
        for name, got in zip(("dk", "dv"), emulate.finish_dkv(partials, rank, shards.kv.dtype)):
            ring[name].add(got, want[name].index_select(2, shards.index[rank]))
    sampled = {name: torch.cat(parts, dim=2) for name, parts in rows.items()}
    return ring, sampled, {"kernel": call.kernel.name, "ranks": ranks}


def _errors(got: torch.Tensor, want: torch.Tensor) -> Errors:
    diff = (got.double() - want.double()).abs()
    if not torch.isfinite(diff).all():
        return Errors(math.inf, math.inf)
    return Errors(diff.max().item(), diff.mean().item())


def _check_row(what, ring_err: Errors, base_err: Errors, yardstick, passed, worst) -> dict:
    return {
        "check": what, "ring_max": ring_err.max, "ring_mean": ring_err.mean,
        "yardstick": yardstick, "yardstick_max": base_err.max, "yardstick_mean": base_err.mean,
        "passed": bool(passed), "worst": worst,
    }  # fmt: skip


def _print_report(data: dict, cfg: MillionConfig) -> None:
    mono, ring = data["monolithic"], data["ring"]
    print(f"\n{'rank':>5} {'fwd ms':>10} {'bwd ms':>10} {'peak MB':>10}")
    for r in ring["ranks"]:
        print(f"{r['rank']:>5} {r['fwd_ms']:>10.1f} {r['bwd_ms']:>10.1f} {r['peak_mb']:>10.0f}")
    print(f"{'mono':>5} {mono['fwd_ms']:>10.1f} {mono['bwd_ms']:>10.1f} {mono['peak_mb']:>10.0f}"
          f"   ({mono['kernel']}, all {cfg.seq_len} tokens)")  # fmt: skip
    print(
        f"efficiency (mono / W) / slowest rank: fwd {ring['efficiency_fwd']:.3f}, fwd+bwd "
        f"{ring['efficiency_fwd_bwd']:.3f}; per-rank TFLOP/s fwd {ring['tflops_fwd']:.3g}, "
        f"fwd+bwd {ring['tflops_fwd_bwd']:.3g}; rank peak / mono peak "
        f"{ring['max_rank_peak_mb'] / mono['peak_mb']:.3f}"
    )
    print(f"\ngates: ring max <= {MAX_RATIO}x and mean <= {MEAN_RATIO}x the yardstick's")
    for c in data["checks"]:
        worst = "" if c["worst"] is None else f" ({c['worst']:.2f} of allowed)"
        print(
            f"  {c['check']:<32} ring {c['ring_max']:.2e}/{c['ring_mean']:.2e}  yardstick "
            f"{c['yardstick']}: {c['yardstick_max']:.2e}/{c['yardstick_mean']:.2e}  "
            f"{'PASS' if c['passed'] else 'FAIL'}{worst}"
        )
    print(f"\n{'PASS' if data['passed'] else 'FAIL'}: emulated {cfg.world_size}-way ring over "
          f"{cfg.seq_len} causal tokens vs monolithic {mono['kernel']}")  # fmt: skip
