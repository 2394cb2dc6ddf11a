"""The project's decoder (models/decoder.py `Transformer`) run over a sharded KV cache.

The model's own modules do all the per-token work (embedding, norms, projections, RoPE, SwiGLU,
output: `Attention.project` and `Attention.output`); only the attend step is replaced, layer by
layer:

    prefill(prompt)   the prompt sharded by the layout (any length: cu_seqlens = [0, S]), each
                      layer's attention = ringattn.attention over the whole prompt; each rank
                      stores the K/V (after RoPE) of its real rows. The last token's hidden row
                      lives on one rank: one all-reduce (zeros elsewhere) gives it to all.
    step(token)       every rank computes the new token (its hidden state is tiny); its K/V go to
                      one rank (round-robin); each rank attends the query over its shard and the
                      partials merge exactly with one collective per layer (partials.py).
    extend(tokens)    a follow-up turn over the persistent cache: pass-KV or pass-Q (turns.py).

Every rank ends each call with the same logits, bit for bit.
"""

from __future__ import annotations

import math

import torch

import ringattn
from ringattn.comm import all_gather_async, all_gather_ints, all_reduce, resolve_group, wait
from ringattn.inference.cache import ShardedKVCache
from ringattn.inference.partials import check_merge, local_partial, merge_across_ranks, self_score
from ringattn.inference.turns import Turn, check_mode, choose_mode, pass_kv, pass_q
from ringattn.kernels import select_kernel
from ringattn.layout import get_layout
from ringattn.models.decoder import Transformer
from ringattn.models.rope import rope_angles
from ringattn.packing import place


class CachedDecoder:
    """`model` over the ranks of `group`, with a sharded KV cache (see module docstring).

    `window`: the number of earlier tokens each query sees (a sliding-window model; None = all);
    it also bounds what the cache keeps. `merge`: "allgather" or "allreduce" (partials.py).
    """

    def __init__(
        self,
        model: Transformer,
        *,
        group: object = None,
        layout: str = "zigzag",
        window: int | None = None,
        merge: str = "allgather",
        backend: str = "auto",
    ):
        get_layout(layout)
        check_merge(merge)
        if window is not None and not (isinstance(window, int) and window >= 0):
            raise ValueError(
                f"window must be None or an int >= 0 (earlier tokens seen), got {window!r}"
            )
        self.model, self.group, self.layout = model, group, layout
        self.info = resolve_group(group)
        self.window, self.merge, self.backend = window, merge, backend
        cfg = model.cfg
        self.cache = ShardedKVCache(cfg.n_layers, self.info.rank, self.info.world_size, window)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.next_pos = 0  # tokens in the sequence so far (all ranks together)
        self.kernel = None
        self.last_mode: str | None = None

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, self.model.cfg.head_dim, self.model.cfg.rope_theta)

    def _window(self) -> tuple[int, int] | None:
        return None if self.window is None else (self.window, 0)

    def _last_logits(self, x: torch.Tensor, positions: torch.Tensor, last: int) -> torch.Tensor:
        """Logits (vocab,) of global position `last`, whose row lives on one rank: shared by one
        all-reduce of the hidden row (exact: the other ranks add zeros)."""
        row = (positions == last).nonzero().flatten()
        hidden = x[0, row].sum(0) if len(row) else x.new_zeros(x.shape[-1])  # (dim,)
        hidden = all_reduce(hidden, self.info)
        model = self.model
        return model.output(model.norm(hidden[None, None]))[0, 0].float()  # (vocab,)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, progress=None) -> torch.Tensor:
        """Run the prompt tokens (S,) int64 through the model; logits (vocab,) of its last token.

        `progress(layers_done, n_layers)` is called after each layer.
        """
        assert self.next_pos == 0, "prefill starts a conversation; use extend for a follow-up"
        model, seq_len = self.model, tokens.numel()
        # a length the layout splits evenly takes the dense schedule (the training forward's:
        # fewer, larger blocks); any other length goes through cu_seqlens = [0, S] and padding
        multiple = self.info.world_size * get_layout(self.layout).chunks_per_rank
        bounds = None if seq_len % multiple == 0 else [0, seq_len]
        common = {"group": self.group, "layout": self.layout, "cu_seqlens": bounds}
        local = ringattn.shard(tokens[None], 1, **common)  # (1, S_local), padding: token 0
        positions = ringattn.positions(seq_len, **common)  # (S_local,), padding: -1
        real = (positions >= 0).nonzero().flatten()
        cos, sin = self._angles(positions)
        x = model.tok_embeddings(local)  # (1, S_local, dim)
        for index, layer in enumerate(model.layers):
            q, k, v = layer.attention.project(layer.attention_norm(x), cos, sin)
            if self.kernel is None:
                self.kernel = select_kernel(self.backend, q, k)
            out = ringattn.attention(
                q, k, v, causal=True, strategy="ring", backend=self.kernel.name,
                window=self._window(), **common,
            )  # fmt: skip
            self.cache.store(index, k[:, :, real], v[:, :, real], positions[real])
            self.cache.evict(index, seq_len)
            x = x + layer.attention.output(out, x.dtype)
            x = x + layer.feed_forward(layer.ffn_norm(x))
            if progress is not None:
                progress(index + 1, len(model.layers))
        self.next_pos = seq_len
        return self._last_logits(x, positions, seq_len - 1)

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token (the same on every rank); logits (vocab,) of the next one."""
        model, position = self.model, self.next_pos
        owner = self.cache.next_owner()
        device = model.tok_embeddings.weight.device
        cos, sin = self._angles(torch.tensor([position], device=device))
        x = model.tok_embeddings(torch.tensor([[token]], device=device))  # (1, 1, dim)
        for index, layer in enumerate(model.layers):
            q, k, v = layer.attention.project(layer.attention_norm(x), cos, sin)  # S = 1
            self.cache.append_decoded(index, k, v, position, owner)
            self.cache.evict(index, position)
            kept = self.cache.kept(index)
            if self.kernel is None:
                self.kernel = select_kernel(self.backend, q, k)
            if kept is None:
                kept = (k[:, :, :0], v[:, :, :0], torch.empty(0, dtype=torch.int64, device=device))
            out, lse = local_partial(self.kernel, q, kept[0], kept[1], self.scale)
            ref = self_score(q, k, self.scale) if self.merge == "allreduce" else None
            out = merge_across_ranks(out, lse, self.info, self.merge, ref)
            x = x + layer.attention.output(out, x.dtype)
            x = x + layer.feed_forward(layer.ffn_norm(x))
        self.cache.decoded += 1
        self.next_pos += 1
        return model.output(model.norm(x))[0, -1].float()  # (vocab,)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, mode: str = "auto") -> torch.Tensor:
        """A follow-up turn: tokens (T,) after everything cached; logits (vocab,) of the last.

        `mode` is "pass-kv", "pass-q" or "auto" (the fewer bytes, turns.choose_mode); the choice
        is kept in `last_mode`.
        """
        check_mode(mode)
        assert self.next_pos > 0, "extend continues a conversation; start it with prefill"
        model, cfg, info = self.model, self.model.cfg, self.info
        new, cached = tokens.numel(), self.next_pos
        lengths = [
            row[0] for row in all_gather_ints([self.cache.tokens], info, torch.device("cpu"))
        ]
        if mode == "auto":
            elem = self.model.tok_embeddings.weight.element_size()
            mode = choose_mode(new, cached, cfg.n_heads, cfg.n_kv_heads, info.world_size,
                               head_dim=cfg.head_dim, kept_tokens=sum(lengths),
                               elem_bytes=elem)  # fmt: skip
        self.last_mode = mode
        layout = get_layout(self.layout)
        placement = place(layout, info.world_size, (0, new))
        common = {"group": self.group, "layout": self.layout, "cu_seqlens": [0, new]}
        local = ringattn.shard(tokens[None], 1, **common)  # (1, T_local)
        index = ringattn.positions(new, **common)
        positions = torch.where(index >= 0, index + cached, index)  # global; -1 padding
        real = (index >= 0).nonzero().flatten()
        turn = Turn(info, self.group, self.layout, placement, cached, self.kernel, self.scale,
                    self.window, lengths, self._gathered_positions(lengths))  # fmt: skip
        cos, sin = self._angles(positions)
        x = model.tok_embeddings(local)  # (1, T_local, dim)
        attend = pass_kv if mode == "pass-kv" else pass_q
        for layer_index, layer in enumerate(model.layers):
            q, k, v = layer.attention.project(layer.attention_norm(x), cos, sin)
            out = attend(turn, q, k, v, self.cache.kept(layer_index))
            self.cache.store(layer_index, k[:, :, real], v[:, :, real], positions[real])
            self.cache.evict(layer_index, cached + new)
            x = x + layer.attention.output(out, x.dtype)
            x = x + layer.feed_forward(layer.ffn_norm(x))
        self.next_pos = cached + new
        return self._last_logits(x, positions, cached + new - 1)

    def _gathered_positions(self, lengths: list[int]) -> list[torch.Tensor] | None:
        """Every rank's kept cache positions: pass-KV needs them to mask a window (else None)."""
        if self.window is None:
            return None
        _, _, mine = self.cache.kept(0)
        longest = max(lengths)
        padded = torch.full((longest,), -1, dtype=torch.int64, device=mine.device)
        padded[: mine.numel()] = mine
        gathered, works = all_gather_async(padded, self.info)
        wait(works)
        return [gathered[r, : lengths[r]] for r in range(self.info.world_size)]
