"""One request as rank 0's scheduler runs it (nano-vllm's engine/sequence.py): its tokens so
far, its place in the ranks' caches, its prefill progress, its sampler (and the logit changes its
request asks for: logits.py), its text stream and the logprobs it reports. The scheduler
(scheduler.py) moves it between waiting, running and ended; what it sends its client (tokens,
text, logprobs, the end) it sends itself (`emit`, `finish`).
"""

from __future__ import annotations

import torch

from ringattn.inference.hf.scoring import Logprobs
from ringattn.inference.sampling import Sampling, next_token
from ringattn.serve.logits import Shaper
from ringattn.serve.pool import Piece, Point
from ringattn.serve.protocol import Job
from ringattn.serve.text import TextStream

__all__ = ["Seq"]


class Seq:
    """One request as the scheduler runs it: its tokens, its cache id and its progress."""

    def __init__(self, job: Job, sink, tokenizer):
        self.job, self.request, self.sink = job, job.request, sink
        self.text = TextStream(tokenizer, self.request.stop)
        r = self.request
        self.sampling = Sampling(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                                 seed=r.seed or 0, min_p=r.min_p)  # fmt: skip
        self.shaper = Shaper(r) if r.shaped else None
        self.generator: torch.Generator | None = None  # made on the logits' device
        self.tokens = list(r.ids)  # what the cache holds once the pending token is fed
        self.out: list[int] = []
        self.id, self.done, self.target, self.failures = -1, 0, 0, 0
        self.hashes: list[list[Point]] = []  # each chunk's hash points (pool.prefix_hashes)
        self.hashed = -1  # of how many tokens `hashes` are
        self.rows = 0  # prompt rows on the fullest rank so far: sum over pieces (pool.py)
        self.pieces: list[Piece] = []  # the pieces of the chunk being prefilled, so far
        self.adopted: list[Piece] = []  # of those, the ones adopted from an entry (cut)
        self.cow = 0  # 1 when the adopted rows end inside a block on some rank (a copy)
        self.base: int | None = None  # the entry those adopted pieces are from
        self.private = 0  # blocks of its earlier chunks that no entry holds (scheduler.rows)
        self.keeping = False  # its piece this step completes a chunk kept as an entry
        self.started = False  # admitted once (a preempted one comes back started)
        self.logprobs = Logprobs(r.ids, r.logprobs, r.prompt_logprobs)  # what it reports

    def restart(self) -> None:
        """Nothing computed or adopted (before an admission, or preempted)."""
        self.done = self.rows = self.private = self.cow = 0
        self.pieces, self.adopted, self.base = [], [], None

    @property
    def prefilling(self) -> bool:
        return self.done < self.target

    def took(self, token: int) -> str | None:
        """Record a sampled token with its shaper; an error message if its grammar refuses it."""
        if self.shaper is None:
            return None
        try:
            self.shaper.accept(token)
        except RuntimeError as err:
            return f"the server failed while generating this request ({err})"
        return None

    def choose(self, shaped: torch.Tensor, greedy: int) -> int:
        """Its next token from its shaped logits row (`greedy`: that row's argmax, already on
        the host), from its own generator when it samples."""
        if self.sampling.greedy:
            return greedy
        if self.generator is None:
            self.generator = self.sampling.generator(shaped.device)
        return next_token(shaped, self.sampling, self.generator)

    def emit(self, token: int | None, row: torch.Tensor | None, eos: set[int]) -> tuple | None:
        """Take `token` (None: none, max_tokens 0) and send it, with its logprobs when asked
        (scoring.py) and the text it completes; how it ended, if it did: ("done", "stop" or
        "length") or ("error", message) (its grammar refused the token), else None."""
        for event in self.logprobs.events(row, token):
            self.sink(*event)
        if token is None:
            return ("done", "length")
        if (refused := self.took(token)) is not None:
            return ("error", refused)
        self.tokens.append(token)
        self.out.append(token)
        self.sink("token")
        piece = self.text.push(token)
        if piece:
            self.sink("text", piece)
        if self.text.stopped or token in eos:
            return ("done", "stop")
        if len(self.out) >= self.request.max_new_tokens:
            return ("done", "length")
        return None

    def finish(self, reason: str) -> None:
        """Send its last text and ("done", reason, usage)."""
        piece = self.text.flush()
        if piece:
            self.sink("text", piece)
        prompt, completion = len(self.request.ids), len(self.out)
        self.sink("done", reason, {"prompt_tokens": prompt, "completion_tokens": completion,
                                   "total_tokens": prompt + completion})  # fmt: skip
