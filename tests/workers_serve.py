"""Rank functions for the server's rank loop on several ranks (see harness.py)."""

from __future__ import annotations

import torch
import transformers

import serve_model
from ringattn.serve.protocol import Request


class _Recorder:
    """A Job's stand-in on every rank: the events of one request."""

    cancelled = False

    def __init__(self):
        self.events, self.arrived = [], 0.0

    def emit(self, *event) -> None:
        self.events.append(event)


class _Done:
    """rank_loop's `http` stand-in: alive until every job has its last event."""

    def __init__(self, jobs: list):
        self.jobs = jobs

    def is_alive(self) -> bool:
        return any(not j.events or j.events[-1][0] not in ("done", "error") for j in self.jobs)


def tiny_model() -> tuple:
    """The served tiny chat model's tokenizer and a random 2-layer Llama over it (seed 5): the
    same weights on every rank and in the test that checks the ranks' answers."""
    tok = serve_model.tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=192,
    )  # fmt: skip
    torch.manual_seed(5)
    return tok, transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def stepped(rank: int, world_size: int, prompts: list[str], max_new: int, cfg: dict,
            fail_at: int | None = None, fail_ranks: list[int] | None = None,
            agree_s: float = 30.0) -> list:  # fmt: skip
    """serve's rank_loop (the step scheduler) over the tiny chat model on every rank, the
    prompts queued at once on rank 0 with ServeConfig(**cfg), the `fail_at`-th forward raising
    once on every rank of `fail_ranks` (default all; a torch forward hook): each request's text
    (rank 0), the plans' count of new requests (every rank), [prefix-hit tokens, preemptions]
    (rank 0), forwards run. An error out of rank_loop after the fault says how long after."""
    import queue
    import time

    from ringattn.comm import resolve_group
    from ringattn.serve.config import ServeConfig
    from ringattn.serve.metrics import Metrics
    from ringattn.serve.worker import rank_loop

    tok, model = tiny_model()
    calls, fault = [0], [None]

    def fail_once(module, args, output):
        calls[0] += 1
        if calls[0] == fail_at and rank in (fail_ranks or range(world_size)):
            fault[0] = time.monotonic()
            raise torch.OutOfMemoryError("simulated")

    model.register_forward_hook(fail_once)
    jobs, recorders = queue.Queue(), []
    if rank == 0:
        for p in prompts:
            recorder = _Recorder()
            recorder.request = Request(tok(p)["input_ids"], max_new)
            recorders.append(recorder)
            jobs.put(recorder)
    metrics = Metrics() if rank == 0 else None
    try:
        served = rank_loop(model, tok, resolve_group(None), "zigzag", jobs, _Done(recorders),
                           ServeConfig(**cfg), metrics=metrics, agree_s=agree_s)  # fmt: skip
    except RuntimeError as err:
        if fault[0] is None:
            raise
        raise RuntimeError(f"{err} [{time.monotonic() - fault[0]:.1f} s after the fault]") from err
    texts = ["".join(e[1] for e in r.events if e[0] == "text") for r in recorders]
    counts = None if metrics is None else [metrics.prefix_hit_tokens, metrics.preemptions]
    return [texts, served, counts, calls[0]]


def adopted(rank: int, world_size: int, chunk: int, cuts: list[int]) -> list:
    """KVEngine over the tiny model on a paged store (blocks of 4): a sequence of 3 chunks
    prefilled chunk by chunk, each chunk kept as an entry, then per cut a sequence sharing its
    first `cut` tokens (then others, 2 chunks + 3 tokens in all) that adopts the rows below
    `cut` and extends the rest in the server's pieces; [cut, max |logits - a plain
    prefill's|, the same with the row at position `cut` (the first sequence's token there)
    adopted too, the blocks of the right one's table it holds alone, those it shares] per
    cut."""
    from ringattn.inference.hf.engine import KVEngine

    _, model = tiny_model()
    engine = KVEngine(model, layout="zigzag")
    paged = engine.page(256, 4, chunk)
    g = torch.Generator(device="cpu").manual_seed(3)
    vocab = model.config.vocab_size
    first = torch.randint(vocab, (3 * chunk,), generator=g, device="cpu")
    out = []
    with torch.no_grad():
        a = engine.open()
        for c, start in enumerate(range(0, first.numel(), chunk)):
            engine.extend(a, first[start : start + chunk])
            engine.keep(c, a, start)
        for cut in cuts:
            rest = (first[cut : 2 * chunk + 3] + 1) % vocab  # differs from `first` at every one
            second = torch.cat([first[:cut], rest])
            plain = engine.prefill([second])[0]
            results = []
            for bound in (cut, cut + 1):
                seq = engine.open()
                engine.adopt(seq, list(range(bound // chunk + 1)), bound)
                at = bound
                while at < second.numel():  # the rest of the cut chunk, then whole chunks
                    stop = min(second.numel(), (at // chunk + 1) * chunk)
                    logits = engine.extend(seq, second[at:stop])
                    at = stop
                results.append(float((logits - plain).abs().max()))
                if bound == cut:
                    blocks = paged.tables[seq].blocks
                    shared = sum(1 for b in blocks if paged.refs[b] > 1)
                    held = [len(blocks) - shared, shared]
            out.append([cut, *results, *held])
    return out


def hybrid_adopted(rank: int, world_size: int, arch: str, chunk: int, cuts: list[int]) -> list:
    """KVEngine over the tiny hybrid `arch` (workers_hf_hybrid.build) on a paged store (blocks
    of 4): a sequence of 3 chunks prefilled chunk by chunk, each kept as an entry with its
    states' snapshot; per cut (a chunk's end) a sequence sharing its first `cut` tokens adopts
    those entries whole (K/V blocks and the mixers' states at the cut) and extends the rest.
    [cut, max |logits - a plain prefill's|, the same adopting the K/V without the states]."""
    import workers_hf_hybrid
    from ringattn.inference.hf.engine import KVEngine

    model = workers_hf_hybrid.build(arch).eval()
    engine = KVEngine(model, layout="zigzag")
    engine.page(256, 4, chunk)
    g = torch.Generator(device="cpu").manual_seed(3)
    vocab = model.config.vocab_size
    first = torch.randint(vocab, (3 * chunk,), generator=g, device="cpu")
    out = []
    with torch.no_grad():
        a = engine.open()
        for c, start in enumerate(range(0, first.numel(), chunk)):
            engine.extend(a, first[start : start + chunk])
            engine.keep(c, a, start)
        for cut in cuts:
            rest = (first[cut : 2 * chunk + 3] + 1) % vocab  # differs from `first` at every one
            second = torch.cat([first[:cut], rest])
            plain = engine.prefill([second])[0]
            results = []
            for states in (True, False):
                engine.hybrid = states  # False: the K/V adopted, the states not (wrong)
                seq = engine.open()
                engine.adopt(seq, list(range(cut // chunk)), cut)
                engine.hybrid = True
                at = cut
                while at < second.numel():  # whole chunks, the last partial
                    stop = min(second.numel(), (at // chunk + 1) * chunk)
                    logits = engine.extend(seq, second[at:stop])
                    at = stop
                results.append(float((logits - plain).abs().max()))
            out.append([cut, *results])
    return out


def waves(rank: int, world_size: int) -> list:
    """A Runner over the tiny model, one step's plan: sequence 0's first chunk (stored as entry
    0) and its second piece, sequence 1 adopting entry 0 and computing its own piece; then a
    decode step. [forwards per step, max |logits - a plain prefill's| of each piece, of each
    decode]: the second piece of 0 and the adopter must wait for the first forward."""
    from ringattn.inference.hf.engine import KVEngine
    from ringattn.serve.runner import Runner

    _, model = tiny_model()
    g = torch.Generator(device="cpu").manual_seed(4)
    a = torch.randint(model.config.vocab_size, (12,), generator=g, device="cpu")
    b = torch.cat([a[:8], (a[8:11] + 1) % model.config.vocab_size])
    runner = Runner(KVEngine(model, layout="zigzag"), 4, 8)
    forwards, step = [], runner.engine.step

    def counted(*args):
        forwards[-1] += 1
        return step(*args)

    runner.engine.step = counted
    plain = lambda ids: model(ids[None], use_cache=False).logits[0, -1].float()
    out = []
    with torch.no_grad():
        forwards.append(0)
        plan = {"evict": [], "free": [], "open": [[0, [], 0], [1, [0], 8]], "decode": [],
                "chunks": [[0, a[:8].tolist(), [0, 0]], [1, b[8:].tolist(), None],
                           [0, a[8:].tolist(), None]]}  # fmt: skip
        _, chunks = runner.step(plan)
        want = [plain(a[:8]), plain(b), plain(a)]
        out.append([float((g - w).abs().max()) for g, w in zip(chunks, want)])
        tokens = [int(chunks[2].argmax()), int(chunks[1].argmax())]
        forwards.append(0)
        plan = {"evict": [], "free": [], "open": [], "chunks": [],
                "decode": [[0, tokens[0]], [1, tokens[1]]]}  # fmt: skip
        decoded, _ = runner.step(plan)
        want = [plain(torch.cat([a, a.new_tensor(tokens[:1])])),
                plain(torch.cat([b, b.new_tensor(tokens[1:])]))]  # fmt: skip
        out.append([float((g - w).abs().max()) for g, w in zip(decoded, want)])
    return [forwards, *out]
