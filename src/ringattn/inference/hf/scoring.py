"""Prompt logprobs under context parallelism: each prompt token's log-probability given the
tokens before it, from the rows each rank holds, without gathering whole logits.

    piece of a prompt: tokens t_a .. t_{a+n-1}, sharded over the ranks by the layout
    rank r holds the rows of some positions i (0 <= i < n) and their logits (vocab,)
    row i predicts t_{a+i+1}: for i < n - 1 that token is in the piece, known on every rank

    each rank:  lp = log_softmax(logits_i)                    (float32, its rows only)
                out[i] = [lp[t_{a+i+1}], top-k values of lp, top-k ids]   rows i < n - 1
                zeros elsewhere
    all ranks:  one all-reduce (sum) of out (n - 1, 1 + 2k) float64: each row has one owner,
                so the sum is that owner's row; ids < 2^53 are exact in float64

The row of the piece's last token (i = n - 1) predicts the token after the piece, which the
next piece (or the sampler) holds: the engine returns that row whole already, and the
scheduler scores it. Bytes moved: (n - 1) x (1 + 2k) x 8 per piece, never n x vocab.
"""

from __future__ import annotations

import torch

from ringattn.comm import GroupInfo, all_reduce

__all__ = ["Entry", "Logprobs", "PromptScores", "entry", "score_rows"]

PromptScores = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(token logprobs (n - 1,) float32, top-k logprobs (n - 1, k) float32, top-k ids (n - 1, k)
int64): row i scores the piece's token i + 1."""


def score_rows(logits: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, k: int,
               info: GroupInfo) -> PromptScores:  # fmt: skip
    """The piece's prompt scores (module docstring) on every rank. `logits` (R, vocab) are this
    rank's rows of the piece, `positions` (R,) their positions within it, `tokens` (n,) the
    piece's token ids, `k` >= 0 the alternatives per row."""
    n = tokens.numel()
    out = torch.zeros(max(0, n - 1), 1 + 2 * k, dtype=torch.float64, device=logits.device)
    inside = positions < n - 1  # the last row predicts the next piece's token
    rows, where = logits[inside], positions[inside]
    if rows.numel():
        lp = torch.log_softmax(rows.float(), dim=-1)  # (R', vocab)
        target = tokens.to(lp.device)[where + 1]
        out[where, 0] = lp.gather(1, target[:, None])[:, 0].double()
        if k:
            top = lp.topk(k, dim=-1)
            out[where, 1 : 1 + k] = top.values.double()
            out[where, 1 + k :] = top.indices.double()
    out = all_reduce(out, info)
    return out[:, 0].float(), out[:, 1 : 1 + k].float(), out[:, 1 + k :].long()


Entry = tuple[int, float, list[tuple[int, float]]]
"""One token's logprob: (token id, its logprob, [(id, logprob) of the k most likely])."""


def entry(row: torch.Tensor, token: int, k: int) -> Entry:
    """The logprob of `token` and the k most likely under the logits `row` (vocab,)."""
    lp = torch.log_softmax(row.float(), dim=-1)
    top = lp.topk(k) if k else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return token, float(lp[token]), pairs


class Logprobs:
    """Rank 0's record of one sequence's logprobs: its generated tokens' (k alternatives each,
    `k` None: none asked) and its prompt's (`prompt_k` alternatives; None: not asked). The prompt
    entries fill in position order as its pieces are computed; position 0 has none (nothing
    precedes it), so it is None, as in the OpenAI API's `echo`."""

    def __init__(self, prompt: list[int], k: int | None, prompt_k: int | None):
        self.prompt, self.k, self.prompt_k = prompt, k, prompt_k
        self.prompt_entries: list[Entry | None] = [None]
        self.sent = False  # the prompt's entries went out (before the first token)

    @property
    def scoring(self) -> bool:
        """Prompt positions still to score (a piece of the prompt must ask for its scores)."""
        return self.prompt_k is not None and len(self.prompt_entries) < len(self.prompt)

    def _add(self, position: int, item: Entry) -> None:
        if position == len(self.prompt_entries) and position < len(self.prompt):
            self.prompt_entries.append(item)  # a recomputed piece repeats nothing

    def piece(self, start: int, n: int, scores: PromptScores | None,
              last: torch.Tensor | None) -> None:  # fmt: skip
        """Record what the piece [start, start + n) of the sequence scored: positions
        start + 1 .. start + n - 1 from `scores`, start + n from its last logits row `last`."""
        if not self.scoring:
            return
        if scores is not None:
            values, top, ids = (x.tolist() for x in scores)
            for i in range(n - 1):
                token = self.prompt[min(start + 1 + i, len(self.prompt) - 1)]
                self._add(start + 1 + i, (token, values[i], list(zip(ids[i], top[i]))))
        if last is not None and start + n < len(self.prompt):
            self._add(start + n, entry(last, self.prompt[start + n], self.prompt_k))

    def events(self, row: torch.Tensor | None, token: int | None) -> list[tuple]:
        """The events to send with a sampled `token` (None: none) of logits `row`: the prompt's
        entries once, before the first token, when asked; the token's entry when asked."""
        out = []
        if self.prompt_k is not None and not self.sent:
            out.append(("prompt", self.prompt_entries))
        self.sent = True
        if token is not None and self.k is not None:
            out.append(("logprobs", [entry(row, token, self.k)]))
        return out
