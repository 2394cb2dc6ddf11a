"""Name a rank that changed its attention arguments after the ranks agreed (see inflight.py).

Every rank's heartbeat carries its attention calls' states (`inflight.snapshot()`). From any set
of them:

    rank b "agreeing" on call n of group g for >= MIN_S           (its new signature or its error)
    rank a of g (a != b) has started call n or later and is not in an agreement
        -> a passed call n's agreement without b: a took the fast path with arguments b does
           not have and waits for b inside the call; b waits for a in the agreement.

No slow peer gives that picture (a slow rank has started fewer calls). Beats are a second old at
most, and the agreement might complete just as they are read (rank a only now joined it), so a
suspicion becomes a verdict only when b's next beat, at least CONFIRM_S later, still shows the
same agreement. The verdict names b, the call and the fields where b's arguments differ from the
others' (or b's local error), in one message that every rank prints:

    under our launcher   the parent's watchdog reads every rank's heartbeat file, kills the
                         ranks and raises LaunchError with the message (heartbeat.Watchdog);
    under torchrun       rank b's own beat thread reads the group's beats from the store, posts
                         the message there and exits EXIT_MISMATCH (76); every other rank's beat
                         thread finds it at its next beat and exits the same way
                         (peer_heartbeat.py).
"""

from __future__ import annotations

__all__ = ["CONFIRM_S", "MIN_S", "MismatchWatch", "suspect"]

MIN_S = 2.0  # how long b waits in the agreement before it is suspected
CONFIRM_S = 1.0  # how much longer b's own beat must show the same agreement


def suspect(records: dict[int, list[dict]], min_s: float = MIN_S) -> tuple | None:
    """(b, entry, ahead ranks, their entry) for the first rank b stuck in an agreement that a
    peer of its group has passed; `records` maps each rank to its published attention states."""
    for b in sorted(records):
        for mine in records[b]:
            if mine["state"] != "agreeing" or mine["for_s"] < min_s:
                continue
            ahead, theirs = [], None
            for a in sorted(records):
                for other in records[a] if a != b else ():
                    if other["group"] != mine["group"] or other["calls"] < mine["call"]:
                        continue
                    if other["state"] == "agreeing":
                        continue  # in an agreement too: the two all-gathers meet
                    ahead.append(a)
                    theirs = theirs or other
            if ahead:
                return b, mine, ahead, theirs
    return None


class MismatchWatch:
    """Suspicions over successive reads of the beats; `observe` returns the verdict once one is
    confirmed by a later beat of the suspected rank."""

    def __init__(self, min_s: float = MIN_S, confirm_s: float = CONFIRM_S):
        self.min_s, self.confirm_s = min_s, confirm_s
        self._seen: dict[tuple, float] = {}  # (b, group, call) -> b's for_s when first suspected

    def observe(self, records: dict[int, list[dict]]) -> tuple[int, str] | None:
        """(rank at fault, message), or None."""
        found = suspect(records, self.min_s)
        if found is None:
            self._seen.clear()
            return None
        b, mine, ahead, theirs = found
        key = (b, mine["group"], mine["call"])
        first = self._seen.setdefault(key, mine["for_s"])
        self._seen = {key: first}
        if mine["for_s"] - first < self.confirm_s:
            return None
        return b, describe(b, mine, ahead, theirs)


def describe(b: int, mine: dict, ahead: list[int], theirs: dict | None) -> str:
    """The verdict, worded the same on every rank."""
    others = ("rank " if len(ahead) == 1 else "ranks ") + ", ".join(map(str, ahead))
    wait = "waits" if len(ahead) == 1 else "wait"
    call = f"attention call {mine['call']} on process group {mine['group']!r}"
    if mine.get("error"):
        what = f"its local checks failed there ({mine['error']}), where {others} passed them"
    else:
        what = f"it called it with {_difference(mine.get('signature'), theirs, others)}"
    return (
        f"rank {b} changed its attention arguments after the ranks had agreed on them: at {call} "
        f"{what}. {others.capitalize()} went on into the call and {wait} inside it for rank {b}, "
        f"which has waited {mine['for_s']:.0f} s for them to agree on the new arguments. Every "
        f"rank of a group must make the same attention calls with the same arguments in the same "
        f"order (check what differs on rank {b}: its batch, its sequence length, its flags); the "
        f"job stops instead of waiting for the process-group timeout"
    )


def _difference(mine: list | None, theirs: dict | None, others: str) -> str:
    """ "q.shape=(1, 4, 64, 16) where ranks 0, 2 pass (1, 4, 32, 16), ..." (or its arguments)."""
    signature = dict(map(tuple, mine or ()))
    if theirs is None or not theirs.get("signature"):
        return ", ".join(f"{n}={_show(v)}" for n, v in signature.items()) or "other arguments"
    other = dict(map(tuple, theirs["signature"]))
    differing = [n for n in signature if signature.get(n) != other.get(n)]
    if not differing:
        return f"the same arguments as {others} (a different call order)"
    verb = "passes" if others.startswith("rank ") else "pass"
    return "; ".join(
        f"{n}={_show(signature.get(n))} where {others} {verb} {_show(other.get(n))}"
        for n in differing
    )


def _show(value: object) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(_show(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)
