"""One model over a sharded KV cache: prefill, batched decode steps, follow-up turns. The one
engine of both model kinds: transformers models (`generate --hf`, ringattn.hf.Session, `serve`)
and ringattn's decoder (`generate`, ringattn.inference.Session; run by inference/native.py).

    engine = KVEngine(model, group=cp_group, layout="zigzag")
    logits = engine.prefill([p0, p1, p2])        # (3, vocab): the prompts packed as documents
    logits = engine.decode([0, 2], [t0, t2])     # (2, vocab): one token for each live sequence
    logits = engine.extend(0, more)              # (vocab,): a follow-up turn of sequence 0
    seq = engine.open(); engine.extend(seq, chunk) # a sequence prefilled chunk by chunk (serve)
    a, b = engine.open(), engine.open()
    logits = engine.prefill([c0, c1], seqs=[a, b])  # opened sequences' first chunks, one forward
    decoded, pieces = engine.step([(a, t_a)], [(b, c1_more), (c, c2)])  # the server's step:
                                                 # decodes and prompt pieces in one forward

Every call switches a transformers model to the "ringattn-kv" attention (kv_attention.py) for
its forward and back afterwards, so the model stays usable in between (ringattn's decoder takes
the state as an argument: nothing to switch); an owner that runs nothing else on the model (the
server's loop) runs inside `with engine.holding():`, which switches once (the switch walks
every module: a few milliseconds per step). The prefill asks the model for the
logits of the rows that end a prompt only (`logits_to_keep` with those local rows): each prompt's
last token lives on one rank, whose row is summed into a (n, vocab) buffer of zeros on the others,
one all-reduce. A sequence can also start empty (`open`) and take its prompt as turns of
`extend`, one fixed-size chunk at a time (the server's chunked prefill): each chunk is placed by
the layout within itself, so a prefix's rows never depend on what follows it, and `rows` /
`adopt` copy a chunk's K/V out of one sequence and into another (prefix reuse). `step` packs
a serving step's decode tokens and prompt pieces into one batch row (kv_attention.py's
segments), so the weights are read once per step, not once per kind of work. The decoded
tokens of each sequence go round-robin over the ranks, starting at a different rank per
sequence, so the shards stay balanced across sequences too.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import torch

import ringattn
from ringattn.comm import all_gather_ints, all_reduce, resolve_group
from ringattn.inference import native
from ringattn.inference.hf import mixer_states
from ringattn.inference.hf.kv_attention import Decode, Extend, Fresh, KVState, attach, restore
from ringattn.inference.hf.scoring import score_rows
from ringattn.inference.paged import PagedStore
from ringattn.inference.turns import Turn, choose_mode
from ringattn.integrations.hf import families, mixers, vision
from ringattn.layout import get_layout
from ringattn.packing import place


class KVEngine:
    """`model` over the ranks of `group` with one sharded cache per sequence (module docstring).
    `merge`: the decode merge, "allgather" or "allreduce" (../partials.py); `backend`: the
    kernel (kernels.select_kernel); `window`: ringattn's decoder only (native.describe)."""

    def __init__(self, model: torch.nn.Module, *, group: object = None, layout: str = "zigzag",
                 offload: bool = False, window: int | None = None, merge: str = "allgather",
                 backend: str = "auto"):  # fmt: skip
        get_layout(layout)
        self.window, shape = window, native.describe(model, window)
        self.native = shape is not None
        self.hybrid = False  # mixers: a prefix entry -> (its end, the mixers' states there)
        self.snapshots: dict[int, tuple[int, dict]] = {}
        if self.native:  # ours: no family to check, no attention implementation to switch
            self.n_layers, self.n_heads, self.n_kv_heads, self.vocab_size, self.mode_sizes = shape
        else:
            self.mode_sizes = {}  # choose_mode's defaults (head_dim 128, 2-byte elements)
            if vision.is_multimodal(model):
                vision.check_family(model)
            else:
                families.check_family(model)
                families.install_guards(model)
            # a hybrid's mixers: refuse a token mixer ringattn does not know, carry the others'
            # states per sequence (mixer_states.py)
            decoder = model.get_decoder() if vision.is_multimodal(model) else model
            self.hybrid = bool(mixers.find_mixers(decoder))
            mixer_states.install(model)
            text = model.config.get_text_config()
            self.n_layers, self.vocab_size = getattr(text, "num_hidden_layers", 0), text.vocab_size
            self.n_heads = getattr(text, "num_attention_heads", None) or 1  # Mamba: no attention
            self.n_kv_heads = getattr(text, "num_key_value_heads", None) or self.n_heads
        self.model, self.group, self.layout = model, group, layout
        self.info = resolve_group(group)
        self.state = KVState(self.info, group, layout, offload, self.n_layers, merge, backend)
        if not offload:  # pages that grow as they fill (the server sizes its own: `page`)
            self.state.paged = PagedStore(64, 16, 1 << 40, self.device, elastic=True)
        # per live sequence (dropped by `release`: a server's engine does not grow with the
        # requests it has served); ids count up from 0 and are never reused
        self.lengths: dict[int, int] = {}  # tokens in each sequence so far
        self.decoded: dict[int, int] = {}  # tokens decoded one at a time (round-robin)
        self.shifts: dict[int, int] = {}  # RoPE position - cache position (a VLM's images)
        self.next_seq = 0
        self.held = False  # holding(): the model stays on "ringattn-kv" between calls
        self.scores: dict = {}  # the last step's prompt logprobs, {piece: PromptScores}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Keep the model on this engine's attention inside the block (its only user then)."""
        previous = None if self.native else attach(self.model, self.state)
        self.held = True
        try:
            yield
        finally:
            self.held = False
            if not self.native:
                restore(self.model, previous)

    def _forward(self, **kwargs) -> torch.Tensor:
        if self.native:  # the state goes in as an argument: nothing to switch
            return native.forward(self.model, self.state, self.window, **kwargs)
        if self.held:
            return self.model(use_cache=False, **kwargs).logits
        previous = attach(self.model, self.state)
        try:
            return self.model(use_cache=False, **kwargs).logits
        finally:
            restore(self.model, previous)

    def _shared_rows(self, logits: torch.Tensor, rows: list[int], n: int) -> torch.Tensor:
        """(n, vocab) float32 on every rank from this rank's logits (1, k, vocab) of `rows`."""
        out = torch.zeros(n, self.vocab_size, dtype=torch.float32, device=logits.device)
        if rows:
            out[torch.tensor(rows, device=logits.device)] = logits[0].float()
        return all_reduce(out, self.info)

    def _fresh(self, prompts: list[torch.Tensor], seqs: list[int]) -> tuple:
        """Prompts packed as documents and sharded: (local ids (S_local,), their positions within
        their prompts (-1: padding), the packed index, the Fresh segment, [(local row, prompt)]
        of the rows that end a prompt)."""
        device = self.device
        lengths = [p.numel() for p in prompts]
        bounds = [0, *itertools.accumulate(lengths)]
        total = bounds[-1]
        common = {"group": self.group, "layout": self.layout, "cu_seqlens": bounds}
        ids = torch.cat([p.to(device) for p in prompts])[None]  # (1, total)
        local = ringattn.shard(ids, 1, **common)[0]  # (S_local,), padding: token 0
        index = ringattn.positions(total, device=device, **common)  # packed index; -1 padding
        within = ringattn.positions(total, within_document=True, device=device, **common)
        starts = torch.tensor(bounds, device=device)
        doc = torch.searchsorted(starts, index.clamp(min=0), right=True) - 1
        rows = []
        for d, length in enumerate(lengths):
            mine = ((doc == d) & (index >= 0)).nonzero().flatten()
            rows.append((seqs[d], mine, within[mine], length))
        ends = {bounds[d + 1] - 1: d for d in range(len(prompts))}
        keep = [(row, ends[i]) for row, i in enumerate(index.tolist()) if i in ends]
        # the bounds are read on the host, like shard_batch's
        return local, within, index, Fresh(torch.tensor(bounds, device="cpu"), rows), keep

    def prefill(self, prompts: list[torch.Tensor], on_layer: Callable[[int], None] | None = None,
                multimodal: dict | None = None,
                seqs: list[int] | None = None) -> torch.Tensor:  # fmt: skip
        """Start one sequence per prompt (S_i,); logits (n, vocab) of each prompt's last token.
        `multimodal` (one prompt only): a VLM's image inputs; the prompt then goes in whole and
        the decoder's pre-hook cuts this rank's rows (vision.py). `seqs`: sequences already
        opened and still empty to start instead of new ones (the server's first chunks of
        several requests in one forward; each prompt is placed by the layout within itself)."""
        device, first = self.device, self.next_seq
        if seqs is not None:
            assert multimodal is None and len(seqs) == len(prompts), "seqs: text prompts, one each"
            assert all(self.lengths[s] == 0 for s in seqs), f"sequences {seqs} are not empty"
        ids_of = list(range(first, first + len(prompts))) if seqs is None else list(seqs)
        local, within, index, fresh, keep = self._fresh(prompts, ids_of)
        lengths, total = [p.numel() for p in prompts], int(fresh.bounds[-1])
        state = self.state
        state.segments, state.on_layer = [(0, local.numel(), fresh)], on_layer
        lengths_kw = {"cu_seq_lens_q": fresh.bounds, "cu_seq_lens_k": fresh.bounds,
                      "max_length_q": max(lengths), "max_length_k": max(lengths),
                      "logits_to_keep": torch.tensor([row for row, _ in keep], dtype=torch.int64,
                                                     device=device)}  # fmt: skip
        if multimodal is not None:  # the whole prompt and its images; the pre-hook cuts
            ids = torch.cat([p.to(device) for p in prompts])[None]
            state.real, state.positions, state.next_position = index >= 0, index, None
            logits = self._forward(input_ids=ids, **multimodal, **lengths_kw)
            state.real = None
            shift = 0 if state.next_position is None else state.next_position - total
        else:
            logits = self._forward(
                input_ids=local[None], position_ids=within.clamp(min=0)[None], **lengths_kw
            )
            shift = 0
        state.on_layer = None
        for seq, length in zip(ids_of, lengths):
            self.lengths[seq] = length
            if seqs is None:  # new sequences (opened ones have their counts already)
                self.decoded[seq], self.shifts[seq] = 0, shift
        if seqs is None:
            self.next_seq += len(prompts)
        return self._shared_rows(logits, [d for _, d in keep], len(prompts))

    def open(self) -> int:
        """A new sequence with nothing cached yet (its tokens come by `extend`); its id."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.lengths[seq] = self.decoded[seq] = self.shifts[seq] = 0
        return seq

    def page(self, n_blocks: int, block: int, chunk: int) -> PagedStore:
        """Keep every sequence's K/V from now on in a paged store of `n_blocks` blocks of
        `block` rows per rank (paged.py; a prompt's chunks of `chunk` tokens start blocks), so
        that prefix entries share blocks rather than copy rows (the server's cache)."""
        if self.state.caches or self.state.offload:
            raise ValueError("page() must come before any sequence, and not with offload")
        self.state.paged = PagedStore(n_blocks, block, chunk, self.device)
        return self.state.paged

    def keep(self, entry: int, seq: int, start: int) -> None:
        """Prefix entry `entry` references seq's rows from position `start` to its end (one
        chunk so far), on this rank: its blocks, no copy (paged.py); a hybrid's, with a snapshot
        of its mixers' states at that end (the same on every rank)."""
        self.state.paged.keep(entry, seq, start, self.lengths[seq])
        if self.hybrid:
            self.snapshots[entry] = (self.lengths[seq], mixer_states.snapshot(self.state, seq))

    def evict(self, entry: int) -> None:
        """Drop prefix entry `entry` (its blocks' references, its snapshot)."""
        self.state.paged.evict(entry)
        self.snapshots.pop(entry, None)

    def adopt(self, seq: int, entries: list[int], tokens: int) -> None:
        """Start the empty sequence `seq` with the rows of `entries` (chunks of other
        sequences, in order) below position `tokens`: whole blocks shared, a cut one copied.
        Exact at any cut: each rank's rows are in increasing position and position p's K/V
        depend on tokens <= p only, whatever placement computed them."""
        assert self.lengths[seq] == 0, "adopt starts an empty sequence"
        if self.hybrid:  # the states at the last entry's end: adopted whole (serve/pool.py)
            end, snap = self.snapshots[entries[-1]]
            assert end == tokens, f"a hybrid adopts entries whole: {tokens} != {end}"
            mixer_states.restore(self.state, seq, snap)
        self.state.paged.adopt(seq, entries, tokens)
        for layer in self.state.paged.k:  # its attention layers' views hold the rows now
            self.state.cache(layer, seq, None)  # (its layer's call sets its window)
        self.lengths[seq] = tokens

    def reserve(self, seqs: list[int], extra: list[int]) -> None:
        """Room in every layer's cache of each sequence for its `extra` decoded tokens."""
        for (_, seq), cache in self.state.caches.items():
            if seq in seqs:
                cache.reserve(extra[seqs.index(seq)])

    def release(self, seq: int) -> None:
        """Free every layer's cache of sequence `seq` (a cancelled request's) and its counts."""
        self.state.drop(seq)
        for counts in (self.lengths, self.decoded, self.shifts):
            counts.pop(seq, None)

    def _decode_segment(self, seqs: list[int], tokens: list[int]) -> tuple:
        """(ids (L,), RoPE positions (L,), the Decode segment) of one token per sequence."""
        device, world = self.device, self.info.world_size
        positions = [self.lengths[s] for s in seqs]
        owners = [(self.decoded[s] + s) % world for s in seqs]
        rope = [p + self.shifts[s] for p, s in zip(positions, seqs)]
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        return ids, torch.tensor(rope, device=device), Decode(list(seqs), positions, owners)

    def _decoded(self, seqs: list[int]) -> None:
        for s in seqs:
            self.lengths[s] += 1
            self.decoded[s] += 1

    def decode(self, seqs: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed one token to each sequence in `seqs`; logits (L, vocab) of their next tokens."""
        ids, rope, step = self._decode_segment(seqs, tokens)
        self.state.segments = [(0, len(seqs), step)]
        one = torch.tensor([0, 1], device="cpu")  # host-side bounds
        logits = self._forward(
            input_ids=ids.view(-1, 1), position_ids=rope.view(-1, 1),  # (L, 1): a batch
            cu_seq_lens_q=one, cu_seq_lens_k=one, max_length_q=1, max_length_k=1,
        )  # fmt: skip
        self._decoded(seqs)
        return logits[:, -1].float()  # (L, vocab)

    def _kept_counts(self, seqs: list[int]) -> list[dict[int, list[int]]]:
        """Per sequence, each layer's kept tokens on every rank (one all-gather for all)."""
        state = self.state
        counts = []
        for seq in seqs:  # a layer's cache is made by the attention call (it knows the window)
            caches = [state.caches.get((layer, seq)) for layer in range(self.n_layers)]
            counts += [0 if c is None else c.tokens for c in caches]
        rows = all_gather_ints(counts, self.info, torch.device("cpu")) if counts else []
        n = self.n_layers
        return [{layer: [row[i * n + layer] for row in rows] for layer in range(n)}
                for i in range(len(seqs))]  # fmt: skip

    def _extend_segment(self, seq: int, tokens: torch.Tensor, lengths: dict[int, list[int]],
                        mode: str) -> tuple:  # fmt: skip
        """(local ids, positions (-1: padding), the Extend segment, local rows of its last
        token) of a turn `tokens` (T,) after everything `seq` holds."""
        device, info = self.device, self.info
        new, cached = tokens.numel(), self.lengths[seq]
        kept = sum(sum(r) for r in lengths.values()) // max(1, len(lengths))  # mean per layer
        if mode == "auto" and info.world_size == 1:
            mode = "pass-kv"  # nothing moves on one rank: the plain kernels, no query gather
        elif mode == "auto":
            mode = choose_mode(new, cached, self.n_heads, self.n_kv_heads, info.world_size,
                               kept_tokens=kept, **self.mode_sizes)  # fmt: skip
        common = {"group": self.group, "layout": self.layout, "cu_seqlens": [0, new]}
        local = ringattn.shard(tokens.to(device)[None], 1, **common)[0]  # (T_local,)
        index = ringattn.positions(new, device=device, **common)
        positions = torch.where(index >= 0, index + cached, index)  # global; -1 padding
        placement = place(get_layout(self.layout), info.world_size, (0, new))
        turn = Turn(info, self.group, self.layout, placement, cached, None, 1.0, None, [])
        rows = (index >= 0).nonzero().flatten()
        last = (positions == cached + new - 1).nonzero().flatten().tolist()
        return local, positions, Extend(seq, mode, turn, rows, positions, lengths), last

    def extend(self, seq: int, tokens: torch.Tensor, mode: str = "auto") -> torch.Tensor:
        """A follow-up turn: tokens (T,) after everything sequence `seq` holds; logits (vocab,)
        of the last one. `mode`: "pass-kv", "pass-q" or "auto" (turns.choose_mode)."""
        lengths = self._kept_counts([seq])[0]
        local, positions, piece, last = self._extend_segment(seq, tokens, lengths, mode)
        self.state.segments = [(0, local.numel(), piece)]
        new = tokens.numel()
        bounds = torch.tensor([0, new], device="cpu")  # host-side bounds
        logits = self._forward(
            input_ids=local[None], position_ids=positions.clamp(min=0)[None],
            cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=new, max_length_k=new,
            logits_to_keep=torch.tensor(last, dtype=torch.int64, device=self.device),
        )  # fmt: skip
        self.lengths[seq] += new
        self.last_mode = piece.mode
        return self._shared_rows(logits, [0] * len(last), 1)[0]

    def step(
        self, decode: list[tuple[int, int]], pieces: list[tuple[int, torch.Tensor]],
        score: dict[int, int] | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:  # fmt: skip
        """One forward for a serving step: a token for each (sequence, token) of `decode`, and
        each prompt piece (sequence, tokens (T,)), packed in one batch row: the decode tokens
        (every rank runs them all), then the pieces of empty sequences as documents (as
        `prefill`), then each other piece placed within itself (as `extend`). A sequence
        appears once. The decode logits (L, vocab) (None without decodes) and the logits
        (vocab,) of each piece's last token. One pass over the weights for the whole step,
        where one forward per kind (and per extended sequence) would read them each time.
        `score` {piece index: k}: those pieces' prompt logprobs with k alternatives per token
        (scoring.py) go to `self.scores` {piece index: PromptScores}."""
        device = self.device
        seqs = [seq for seq, _ in decode] + [seq for seq, _ in pieces]
        assert len(set(seqs)) == len(seqs), f"a sequence twice in one step: {seqs}"
        parts = []  # (ids, positions, segment) in row order
        keep = []  # (local row, piece) of the rows that end a piece
        score = score or {}
        scored = {}  # piece -> (local rows, their positions within the piece)
        if decode:
            parts.append(self._decode_segment(*map(list, zip(*decode))))
        fresh = [j for j, (seq, _) in enumerate(pieces) if self.lengths[seq] == 0]
        at = len(decode)
        if fresh:
            local, within, _, what, ends = self._fresh(
                [pieces[j][1] for j in fresh], [pieces[j][0] for j in fresh]
            )
            parts.append((local, within.clamp(min=0), what))
            keep += [(at + row, fresh[d]) for row, d in ends]
            for d, (_, mine, where, _) in enumerate(what.rows):
                if fresh[d] in score:
                    scored[fresh[d]] = (at + mine, where)
            at += local.numel()
        others = [j for j in range(len(pieces)) if j not in fresh]
        counts = self._kept_counts([pieces[j][0] for j in others])
        for j, lengths in zip(others, counts):
            local, where, what, last = self._extend_segment(*pieces[j], lengths, "auto")
            parts.append((local, where.clamp(min=0), what))
            if j in score:
                scored[j] = (at + what.rows, where[what.rows] - self.lengths[pieces[j][0]])
            keep += [(at + row, j) for row in last]
            at += local.numel()
        ids, positions, _ = zip(*parts)
        starts = [0, *itertools.accumulate(x.numel() for x in ids)]
        self.state.segments = [(a, b, what) for a, b, (_, _, what) in
                               zip(starts, starts[1:], parts)]  # fmt: skip
        rows = list(range(len(decode))) + [row for row, _ in keep]
        scored_at = len(rows)
        rows += [r for local_rows, _ in scored.values() for r in local_rows.tolist()]
        bounds = torch.tensor([0, at], device="cpu")  # host-side; the segments say the rest
        logits = self._forward(
            input_ids=torch.cat(ids)[None], position_ids=torch.cat(positions)[None],
            cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=at, max_length_k=at,
            logits_to_keep=torch.tensor(rows, dtype=torch.int64, device=device),
        )  # fmt: skip
        decoded = logits[0, : len(decode)].float() if decode else None
        out = []
        if pieces:
            kept = logits[:, len(decode) : scored_at]
            out = list(self._shared_rows(kept, [j for _, j in keep], len(pieces)))
        self.scores = {}
        for j, (local_rows, where) in scored.items():  # in piece order on every rank
            these = logits[0, scored_at : scored_at + local_rows.numel()]
            scored_at += local_rows.numel()
            self.scores[j] = score_rows(these, where, pieces[j][1], score[j], self.info)
        self._decoded([seq for seq, _ in decode])
        for seq, tokens in pieces:
            self.lengths[seq] += tokens.numel()
        return decoded, out
