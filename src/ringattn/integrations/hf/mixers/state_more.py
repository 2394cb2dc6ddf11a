"""More "state" programs (state.py): Mamba1's selective scan, MiniMax's lightning attention
and Kimi's delta attention (KDA).

Each re-runs the layer's own parameters on this rank's runs (one right-padded batch row per run),
computes the recurrence from a zero state, and adds what the entering state contributes, which
is linear in it:

    Mamba1 (selective scan)    S_t = exp(A dt_t) * S_(t-1) + dt_t B_t x_t      (D, N) per channel
                               A_run = exp(A sum dt)                           (D, N), elementwise
                               y_t += sum_n C_t[n] exp(A cumsum(dt)_t)[d, n] S_in[d, n]
    lightning attention        S_t = lambda S_(t-1) + k_t^T v_t                (K, V) per head
                               lambda = exp(-slope) per head, A_run = lambda^L
                               y_t += lambda^(t+1) q_t S_in           (t counted from the run start)
    KDA                        the gated delta rule with a decay per key channel: state.py's
                               augmented identity, [0 | I], through the family's chunked KDA

The scans are the family's own functions (`mamba_selective_scan`, `chunk_kimi_delta_attention`:
mamba-ssm's and flash-linear-attention's kernels where installed); lightning attention has no
function of its own in transformers (its forward loops over blocks inline), so its block loop is
restated here with the module's own decay buffers. Padding rows are identity steps (Mamba1:
dt = 0; KDA: g = 0, beta = 0; lightning: k = 0, and the run's final state is taken at its last
real token). The entering states come from `state.entering_states` and the convolution halos
from `state._conv`, looked up on that module at call time as its own programs do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ringattn.integrations.hf.mixers import state

# ---- Mamba1 (selective scan) -------------------------------------------------------------


def _selective_scan(module, u, dt, A, B, C, D, valid, ex):
    """Mamba1's scan of this rank's runs, each from its entering state, before the gate; one
    call of the family's scan per head (Zamba's heads have their own x_proj, A and D; Mamba's
    one head is all channels).

    u and dt (n, H, P, L) (dt after softplus), A (H, P, N), B and C (n, H, N, L), D (H, P)
    -> (n, H, P, L) float32, D's skip term included."""
    dt = dt * valid[:, None, None, :].to(dt.dtype)  # padding: no decay, no write
    scan = state._family(module, "mamba_selective_scan")
    y0, final = zip(*(
        scan(u[:, h], dt[:, h], A[h], B[:, h], C[:, h], D=D[h].float(), z=None, delta_bias=None,
             delta_softplus=False, return_last_state=True,
             use_mambapy=getattr(module, "use_mambapy", False),
             use_associative_scan=getattr(module, "use_associative_scan", False))
        for h in range(u.shape[1])
    ))  # fmt: skip
    y0, final = torch.stack(y0, 1).float(), torch.stack(final, 1).float()  # final (n, H, P, N)
    log_decay = torch.cumsum(dt.float(), dim=-1)  # (n, H, P, L), times A below
    transition = torch.exp(A[None] * log_decay[..., -1:])  # (n, H, P, N)
    s_in = state.entering_states(transition, final, ex, torch.mul)  # (n, H, P, N)
    C = C.float()
    carried = [
        checkpoint(_carry, A, log_decay[..., a : a + _BLOCK], C[..., a : a + _BLOCK], s_in,
                   use_reentrant=False)
        for a in range(0, u.shape[-1], _BLOCK)
    ]  # fmt: skip
    return y0 + torch.cat(carried, dim=-1)


# tokens per block of the entering state's term: its decay, (D, block, N), is made again in the
# backward (torch.utils.checkpoint) instead of kept, as mamba-ssm's scan keeps no (D, L, N) either
_BLOCK = 512


def _carry(A, log_decay, C, s_in):
    """What the entering state adds, sum_s C_t[s] exp(A cumsum(dt)_t)[:, s] S_in[:, s]:
    A (H, P, N), log_decay (n, H, P, l), C (n, H, N, l), s_in (n, H, P, N) -> (n, H, P, l)."""
    decay = torch.exp(A[None, :, :, None, :] * log_decay[..., None])  # (n, H, P, l, N)
    return torch.einsum("nhpls,nhsl,nhps->nhpl", decay, C, s_in)


def mamba1(module, x, valid, ex):
    """MambaMixer, FalconMambaMixer (RMS norms on dt, B, C) and JambaMambaMixer (the same,
    with weights)."""
    dtype = x.dtype
    xs, gate = module.in_proj(x).chunk(2, dim=-1)  # (n, L, D) each
    xs = state._conv(module, module.conv1d, xs, valid, ex, module.activation)
    rank, size = module.time_step_rank, module.ssm_state_size
    time_step, B, C = torch.split(module.x_proj(xs), [rank, size, size], dim=-1)
    if hasattr(module, "dt_layernorm"):
        time_step = module.dt_layernorm(time_step)
        B, C = module.b_layernorm(B), module.c_layernorm(C)
    if hasattr(module.config, "_is_quantized"):  # as the layer's forward calls a quantized Linear
        time_step = (module.dt_proj(time_step) - module.dt_proj.bias).transpose(1, 2)
    else:
        time_step = module.dt_proj.weight @ time_step.transpose(1, 2)  # (n, D, L)
    dt = F.softplus(time_step + module.dt_proj.bias.float().to(time_step.dtype)[:, None])
    A = -torch.exp(module.A_log.float())  # (D, N)
    y = _selective_scan(
        module, xs.transpose(1, 2)[:, None], dt[:, None], A[None], B.transpose(1, 2)[:, None],
        C.transpose(1, 2)[:, None], module.D[None], valid, ex,
    )[:, 0]  # fmt: skip
    for doc, final in ex.finals.items():  # a prefill's: transformers' cache holds (D, N)
        ex.finals[doc] = final[0]
    y = y * F.silu(gate.transpose(1, 2))  # (n, D, L)
    return module.out_proj(y.transpose(1, 2).to(dtype))


def zamba_mamba(module, x, valid, ex):
    """ZambaMambaMixer: Mamba1 in heads, each with its own x_proj, dt_proj, A and D; in_proj's
    outputs interleave the scan input and the gate channel by channel."""
    n, length, _ = x.shape
    heads, width = module.n_mamba_heads, module.mamba_head_dim
    projected = module.in_proj(x).view(n, length, -1, 2)  # (n, L, D, 2)
    xs, gate = projected[..., 0], projected[..., 1]
    xs = state._conv(module, module.conv1d, xs.contiguous(), valid, ex, module.activation)
    hs = xs.transpose(1, 2).reshape(n, heads, width, length)  # (n, H, P, L)
    params = (module.x_proj_weight[None] @ hs).transpose(-1, -2)  # (n, H, L, R + 2N)
    rank, size = module.time_step_rank, module.ssm_state_size
    time_step, B, C = torch.split(params, [rank, size, size], dim=-1)
    time_step = module.dt_proj_weight[None] @ time_step.transpose(-1, -2)  # (n, H, P, L)
    dt = F.softplus(time_step + module.dt_proj_bias.float().to(time_step.dtype)[..., None])
    A = -torch.exp(module.A_log.float())  # (H, P, N)
    y = _selective_scan(
        module, hs, dt, A, B.transpose(-1, -2), C.transpose(-1, -2), module.D, valid, ex
    )
    y = y * F.silu(gate.transpose(1, 2).reshape(n, heads, width, length))
    return module.out_proj(y.reshape(n, heads * width, length).transpose(1, 2).to(x.dtype))


# ---- lightning attention (MiniMax) -------------------------------------------------------


def _lightning_blocks(module, q, k, v):
    """The layer's block loop from a zero state: q, k, v (n, H, L, K) -> (n, H, L, K)."""
    n, heads, length, width = v.shape
    size = module.block_size
    kv = v.new_zeros(n, heads, width, width)
    out = []
    for start in range(0, length, size):
        c = min(size, length - start)
        qb, kb, vb = (t[:, :, start : start + c] for t in (q, k, v))
        intra = ((qb @ kb.transpose(-1, -2)) * module.diagonal_decay[:, :, :c, :c]) @ vb
        out.append((qb * module.query_decay[:, :c]) @ kv + intra)
        kv = kv * torch.exp(-module.slope_rate * c) + (kb * module.key_decay[:, -c:]).mT @ vb
    return torch.cat(out, dim=2)


def lightning(module, x, valid, ex):
    """MiniMaxLightningAttention: a linear attention whose state decays by exp(-slope) per head
    and token; RMS norm, a sigmoid output gate and the out projection after it."""
    n, length, _ = x.shape
    heads, width = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(x)).reshape(n, length, heads, 3 * width)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, width, dim=3))  # (n, H, L, K)
    k = k * valid[:, None, :, None].to(k.dtype)  # padding: no write
    y0 = _lightning_blocks(module, q, k, v)
    slope = module.slope_rate.view(1, heads, 1)
    lengths = valid.sum(1)  # (n,)
    positions = torch.arange(length, device=x.device)
    age = (lengths[:, None] - 1 - positions[None]).clamp(min=0)  # (n, L): decay steps to the end
    final = torch.einsum("nhl,nhlk,nhlv->nhkv", torch.exp(-slope * age[:, None]), k, v)
    transition = torch.exp(-slope[..., 0] * lengths[:, None])  # (n, H)
    s_in = state.entering_states(transition, final, ex, lambda a, s: a[:, None, None] * s)
    carried = (q * torch.exp(-slope * (positions + 1))[..., None]) @ s_in  # (n, H, L, K)
    y = (y0 + carried).transpose(1, 2).reshape(n, length, heads * width)
    y = F.sigmoid(module.output_gate(x)) * module.norm(y)
    return module.out_proj(y)


# ---- Kimi delta attention (KDA) ----------------------------------------------------------


def _kda_rule(module, q, k, v, g, beta, valid, ex):
    """The delta rule with a per-channel decay over this rank's runs, from their entering states
    (state.py's augmented identity: S (K, V + K) from [0 | I] gives B_run, A_run and q^T A):
    q, k, v (n, L, H, K), g (n, L, H, K), beta (n, L, H) -> (n, L, H, V)."""
    g = g * valid[..., None, None].to(g.dtype)  # padding: identity steps
    beta = beta * valid[..., None].to(beta.dtype)
    n, length, heads, width = v.shape
    dk = k.shape[-1]
    eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(n, heads, dk, dk)
    start = torch.cat([eye.new_zeros(n, heads, dk, width), eye], dim=-1)  # [0 | I]
    v_aug = torch.cat([v, v.new_zeros(n, length, heads, dk)], dim=-1)
    out, final = state._family(module, "chunk_kimi_delta_attention")(
        q, k, v_aug, g=g, beta=beta, initial_state=start, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    y0, carry = out[..., :width], out[..., width:]  # (n, L, H, V), (n, L, H, K)
    s_in = state.entering_states(final[..., width:], final[..., :width], ex, torch.matmul)
    carried = torch.einsum("nlhk,nhkv->nlhv", carry.to(s_in.dtype), s_in)
    return y0 + carried.to(y0.dtype)


def kimi_kda(module, x, valid, ex):
    """KimiLinearDeltaAttention: q/k/v convolved, a per-channel forget gate, the gated norm."""
    n, length, _ = x.shape
    shape = (n, length, -1, module.head_dim)
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    mixed = state._conv(module, module.conv1d, mixed, valid, ex, module.activation)
    q, k, v = (t.reshape(shape) for t in torch.split(mixed, [module.qkv_dim] * 3, dim=-1))
    g = module.forget_gate(x)  # (n, L, H, K)
    beta = torch.sigmoid(module.b_proj(x))
    core = _kda_rule(module, q, k, v, g, beta, valid, ex)
    gate = module.g_b_proj(module.g_a_proj(x)).view(shape)
    return module.o_proj(module.o_norm(core, gate).reshape(n, length, -1))


# class name -> program (passing.py merges these with state.py's)
PROGRAMS: dict[str, Callable] = {
    "MambaMixer": mamba1,
    "FalconMambaMixer": mamba1,
    "JambaMambaMixer": mamba1,
    "ZambaMambaMixer": zamba_mamba,
    "MiniMaxLightningAttention": lightning,
    "KimiLinearDeltaAttention": kimi_kda,
}
