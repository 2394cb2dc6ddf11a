"""The "state" scheme: each rank runs a mixer on its own tokens only, from exchanged states.

A mixer layer is per-token work around two sequence operations, a causal convolution and a
linear recurrence. This module runs the layer's own parameters and transformers' own functions
for both (the family's `causal_conv1d_fn`, `mamba2_chunk_scan`, `torch_chunk_gated_delta_rule`,
which are the causal-conv1d, mamba-ssm and flash-linear-attention kernels where installed) on
this rank's runs (runs.py), one batch row per run:

    x (n_runs, L, hidden)            this rank's rows, one right-padded row per run
      projections                    the layer's own Linear modules, per token
      conv(halo + run)               the K-1 inputs before each run come from their owners
      recurrence from a zero state   -> y0 per token, the run's final state B_run, its transition
                                        A_run and, per token, what the entering state adds:
            Mamba2 (SSD)             A_run = exp(sum dt A) per head, and
                                     y_t += exp(cumsum dt A)_t C_t S_in
            gated delta rule         state width V + K from [0 | I]: the extra K columns carry
                                     A_(1..t) = prod g (I - beta k k^T), so one call gives
                                     B_run, A_run and P_t = q_t^T A_(1..t); y_t += P_t S_in
      S_in = the fold of the runs before (runs.entering_states: one all-gather of (A, B))
      gate, norm, out projection     the layer's own modules, per token

Padding rows are identity steps (dt = 0, beta = 0, g = 0: no decay and no write), so a run's
final state is its last real token's. The recurrence is linear in the entering state, so adding
its contribution after the zero-state call is exact (the order of float additions aside), and
autograd through these torch functions gives the backward: the state gradients reach the ranks
whose runs made the states through the all-gather's reduce-scatter.

Compute and activations are those of this rank's tokens (the delta rule's state is K columns
wider); traffic per layer per rank: the halos (W x runs x (K-1) x conv channels) and the
summaries (W x runs x heads x state), independent of S.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ringattn.comm import GroupInfo
from ringattn.integrations.hf.mixers.relayout import move_rows, moved_bytes, plan_move
from ringattn.integrations.hf.mixers.runs import (
    Exchange,
    entering_states,
    from_runs,
    halos,
    keep_conv,
    runs_of,
    to_runs,
)
from ringattn.layout import get_layout
from ringattn.packing import Placement, place


def _family(module: nn.Module, name: str) -> Callable:
    """The function `name` of the module's own modeling file (its kernel or torch fallback)."""
    return vars(sys.modules[type(module).__module__])[name]


def _conv(
    module: nn.Module,
    conv: nn.Conv1d,
    mixed: torch.Tensor,
    valid: torch.Tensor,
    ex: Exchange,
    activation: str | None,
) -> torch.Tensor:
    """(n, L, C) conv inputs -> (n, L, C) the layer's causal depthwise convolution, each run
    reading its halo (the inputs before it in its document) instead of zeros."""
    width = conv.weight.shape[-1] - 1
    if ex.keep:
        keep_conv(mixed, valid, width + 1, ex)
    halo = halos(mixed, valid, width, ex)  # (n, K-1, C)
    full = torch.cat([halo, mixed], dim=1).transpose(1, 2)  # (n, C, K-1 + L)
    kwargs = {} if activation is None else {"activation": activation}
    out = _family(module, "causal_conv1d_fn")(full, conv.weight.squeeze(1), conv.bias, **kwargs)
    return out[:, :, width:].transpose(1, 2)  # the halo's own outputs dropped


# ---- Mamba2 (SSD) ------------------------------------------------------------------------


def _ssd(module, hs, dt, B, C, valid, ex):
    """Mamba2's chunked scan of this rank's runs, each from its entering state.

    hs (n, L, H, P), dt (n, L, H) after softplus, B and C (n, L, G, N) -> (n, L, H, P) float32."""
    A = -torch.exp(module.A_log.float())  # (H,)
    dt = dt * valid[..., None].to(dt.dtype)  # padding: no decay, no write
    y0, final = _family(module, "mamba2_chunk_scan")(
        hs, dt, A, B, C, chunk_size=module.chunk_size, D=module.D, dt_bias=None,
        dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=True,
    )  # fmt: skip
    log_decay = torch.cumsum(dt.float() * A, dim=1)  # (n, L, H)
    s_in = entering_states(
        log_decay[:, -1].exp(), final, ex, lambda a, s: a[:, None, None] * s
    )  # (n, H, P, N)
    heads = hs.shape[2]
    c = C.float().repeat_interleave(heads // C.shape[2], dim=2)  # (n, L, H, N)
    carried = torch.einsum("nlhs,nhps->nlhp", c, s_in.to(c.dtype))
    return y0 + log_decay.exp()[..., None] * carried


def mamba2(module, x, valid, ex):
    """Mamba2Mixer and its copies (Nemotron-H, Bamba, Granite 4, Zamba2, Falcon-H1's)."""
    n, length, _ = x.shape
    dtype = x.dtype
    if hasattr(module, "ssm_in_multiplier"):  # Falcon-H1's muP multipliers
        x = x * module.ssm_in_multiplier
    projected = module.in_proj(x)
    if hasattr(module, "mup_vector"):
        projected = projected * module.mup_vector
    inner, groups, state = module.intermediate_size, module.n_groups, module.ssm_state_size
    gate, xbc, dt = projected.split([inner, module.conv_dim, module.num_heads], dim=-1)
    xbc = _conv(module, module.conv1d, xbc, valid, ex, module.activation)
    hs, B, C = torch.split(xbc, [inner, groups * state, groups * state], dim=-1)
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=module.time_step_limit[0], max=module.time_step_limit[1])
    y = _ssd(
        module,
        hs.view(n, length, module.num_heads, module.head_dim),
        dt,
        B.view(n, length, groups, state),
        C.view(n, length, groups, state),
        valid,
        ex,
    ).reshape(n, length, -1)
    if getattr(module, "mamba_rms_norm", True):
        y = module.norm(y, gate)
    else:  # Falcon-H1 without its gated norm
        y = y * F.silu(gate)
    return module.out_proj(y.to(dtype))


# ---- gated DeltaNet ----------------------------------------------------------------------


def _delta_rule(module, q, k, v, g, beta, valid, ex):
    """The gated delta rule over this rank's runs from their entering states (module docstring):
    q, k (n, L, Hk, K), v (n, L, Hv, V), g and beta (n, L, Hv) -> (n, L, Hv, V)."""
    mask = valid[..., None]
    g, beta = g * mask.to(g.dtype), beta * mask.to(beta.dtype)  # padding: identity steps
    n, length, heads, width = v.shape
    dk = k.shape[-1]
    eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(n, heads, dk, dk)
    start = torch.cat([eye.new_zeros(n, heads, dk, width), eye], dim=-1)  # [0 | I]
    v_aug = torch.cat([v, v.new_zeros(n, length, heads, dk)], dim=-1)
    out, final = _family(module, "torch_chunk_gated_delta_rule")(
        q, k, v_aug, g=g, beta=beta, initial_state=start, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    y0, carry = out[..., :width], out[..., width:]  # (n, L, Hv, V), (n, L, Hv, K)
    s_in = entering_states(final[..., width:], final[..., :width], ex, torch.matmul)
    carried = torch.einsum("nlhk,nhkv->nlhv", carry.to(s_in.dtype), s_in)
    return y0 + carried.to(y0.dtype)


def _gdn_core(module, mixed, b, a, valid, ex, beta_scale=1.0):
    """Conv, split, the recurrence: (n, L, 2 key + value channels) -> (n, L, Hv, V)."""
    n, length, _ = mixed.shape
    mixed = _conv(module, module.conv1d, mixed, valid, ex, module.activation)
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(n, length, -1, module.head_k_dim)
    k = k.reshape(n, length, -1, module.head_k_dim)
    v = v.reshape(n, length, -1, module.head_v_dim)
    beta = b.sigmoid() * beta_scale
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return _delta_rule(module, q, k, v, g, beta, valid, ex)


def _gated_out(norm, out_proj, core, gate, head_dim):
    n, length = core.shape[:2]
    y = norm(core.reshape(-1, head_dim), gate.reshape(-1, head_dim))
    return out_proj(y.reshape(n, length, -1))


def qwen3_5_gdn(module, x, valid, ex):
    """Qwen3.5's gated DeltaNet: in_proj_qkv, _z, _b, _a."""
    core = _gdn_core(
        module, module.in_proj_qkv(x), module.in_proj_b(x), module.in_proj_a(x), valid, ex
    )
    return _gated_out(module.norm, module.out_proj, core, module.in_proj_z(x), module.head_v_dim)


def qwen3_next_gdn(module, x, valid, ex):
    """Qwen3-Next's gated DeltaNet: in_proj_qkvz and in_proj_ba, grouped by key head."""
    n, length, _ = x.shape
    qkvz, ba = module.in_proj_qkvz(x), module.in_proj_ba(x)
    q, k, v, z, b, a = module.fix_query_key_value_ordering(qkvz, ba)
    mixed = torch.cat([t.reshape(n, length, -1) for t in (q, k, v)], dim=-1)
    core = _gdn_core(module, mixed, b, a, valid, ex)
    return _gated_out(module.norm, module.out_proj, core, z, module.head_v_dim)


def olmo_hybrid_gdn(module, x, valid, ex):
    """OLMo-hybrid's gated DeltaNet: q/k/v/b/a/g projections, beta doubled with negative
    eigenvalues allowed."""
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    scale = 2.0 if module.allow_neg_eigval else 1.0
    core = _gdn_core(module, mixed, module.b_proj(x), module.a_proj(x), valid, ex, scale)
    return _gated_out(module.o_norm, module.o_proj, core, module.g_proj(x), module.head_v_dim)


# ---- short convolutions ------------------------------------------------------------------


def lfm2_short_conv(module, x, valid, ex):
    """LFM2's short convolution: B * x convolved (halo from the run before), gated by C."""
    B, C, h = module.in_proj(x).chunk(3, dim=-1)
    y = C * _conv(module, module.conv, B * h, valid, ex, None)
    return module.out_proj(y.contiguous())


# class name -> (n_runs, L, hidden) runs -> (n_runs, L, hidden) outputs, from entering states
PROGRAMS: dict[str, Callable] = {
    "Mamba2Mixer": mamba2,
    "NemotronHMamba2Mixer": mamba2,
    "FalconH1Mixer": mamba2,
    "GraniteMoeHybridMambaLayer": mamba2,
    "BambaMixer": mamba2,
    "Zamba2MambaMixer": mamba2,
    "Qwen3_5GatedDeltaNet": qwen3_5_gdn,
    "Qwen3_5MoeGatedDeltaNet": qwen3_5_gdn,
    "Qwen3NextGatedDeltaNet": qwen3_next_gdn,
    "OlmoHybridGatedDeltaNet": olmo_hybrid_gdn,
    "Lfm2ShortConv": lfm2_short_conv,
    "Lfm2MoeShortConv": lfm2_short_conv,
}


def has_state(module: nn.Module) -> bool:
    """True when `module`'s class runs by state passing."""
    return type(module).__name__ in PROGRAMS


def run_state(
    module: nn.Module, x: torch.Tensor, placement: Placement, info: GroupInfo, keep: bool = False
) -> tuple[torch.Tensor, Exchange]:
    """(S_local, H) this rank's rows -> (S_local, H) the layer's outputs by state passing, and
    the call's Exchange (bytes sent; with `keep`, each document's final states). A striped
    layout's rows go to the zigzag placement of the same documents and back (relayout.py)."""
    runs_placement = placement
    if any(run.stride != 1 for runs in placement.runs for run in runs):
        runs_placement = place(get_layout("zigzag"), info.world_size, placement.bounds)
        there = plan_move(placement, runs_placement, info.rank)
        back = plan_move(runs_placement, placement, info.rank)
        x = move_rows(x, there, info)
    exchange = Exchange(runs_of(runs_placement, info.rank), info, keep=keep)
    rows, valid = to_runs(x, exchange.runs)  # (n_runs, L, H)
    y = PROGRAMS[type(module).__name__](module, rows, valid, exchange)
    out = from_runs(y, exchange.runs, runs_placement.local_len)
    if runs_placement is placement:
        return out, exchange
    row_bytes = x.shape[-1] * x.element_size()
    exchange.sent += moved_bytes(there, row_bytes, info.rank) + moved_bytes(
        back, row_bytes, info.rank
    )
    return move_rows(out, back, info), exchange
