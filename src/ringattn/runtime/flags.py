"""The checks that every command's flags share, written once: a name among its choices, a number
at or above its bound. Each raises ValueError naming the flag, the value and the fix, so that
`ringattn train`, `demo` and `generate` word the same mistake the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["check_at_least", "check_choice"]


def check_choice(flag: str, value: object, choices: Iterable[str]) -> None:
    """ValueError unless `value` is one of `choices`: "unknown --flag 'x'; choose from a, b"."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown --{flag} {value!r}; choose from {', '.join(choices)}")


def check_at_least(flag: str, value: object, low: int) -> None:
    """ValueError unless `value` is an int >= `low`: "--flag must be >= 1, got 0"."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"--{flag} must be >= {low}, got {value!r}")
