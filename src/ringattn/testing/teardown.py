"""Test fixtures that start machinery outside this process (network namespaces, Slurm daemons)
and must take it down however the process ends.

    class TwoHosts(Teardown):
        def _start(self): ...      # make it; on any error __enter__ calls close() and re-raises
        def close(self): ...       # idempotent; ends with self._disarm()

`with X() as x:` arms `close()` for the normal exit, for the interpreter's exit (atexit) and, when
SIGTERM still has its default action in the main thread, for a SIGTERM of this process (a test run
cut short by `timeout`): then `close()` runs and the process exits 128 + 15.
"""

from __future__ import annotations

import atexit
import signal
import threading

from typing_extensions import Self

__all__ = ["Teardown"]


class Teardown:
    """Base of a context manager whose `close()` also runs at exit and on SIGTERM."""

    _previous_sigterm: object = None

    def _start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        atexit.register(self.close)
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _disarm(self) -> None:
        """Give SIGTERM back its previous action (the end of `close()`)."""
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
