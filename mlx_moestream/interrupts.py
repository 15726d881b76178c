"""Ctrl-C never splits a cache decision from the read that fulfils it.

Between giving an expert a slot and filling that slot, an interrupt would leave the expert
marked resident over another expert's bytes, and every later token could be wrong. The runtime
runs such steps inside `critical()`: a SIGINT that arrives there is delivered when the step
ends, a few milliseconds later, wherever the caller expects it (`chat` goes on with the same
model). Signals reach only the main thread, so only its steps defer them.
"""

from __future__ import annotations

import signal
import threading

_MAIN = threading.main_thread().ident


class _Deferral:
    depth = 0  # critical steps the main thread is inside
    pending: tuple | None = None  # (signum, frame) of a SIGINT that arrived inside one
    previous = None  # the handler ours wraps


def install_handler() -> None:
    """Route SIGINT through the deferral. Only from the main thread, and only over a Python
    handler (the default raises KeyboardInterrupt); a handler set later replaces ours."""
    if threading.get_ident() != _MAIN:
        return
    current = signal.getsignal(signal.SIGINT)
    if current is _on_sigint or not callable(current):
        return
    _Deferral.previous = current
    signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum, frame) -> None:
    if _Deferral.depth:
        _Deferral.pending = (signum, frame)
    else:
        _Deferral.previous(signum, frame)


class critical:
    """A step that must finish once started: SIGINT waits for its end."""

    __slots__ = ()

    def __enter__(self) -> None:
        if threading.get_ident() == _MAIN:
            _Deferral.depth += 1

    def __exit__(self, *exc) -> None:
        if threading.get_ident() != _MAIN:
            return
        pending = _Deferral.pending if _Deferral.depth == 1 else None
        if pending:
            _Deferral.pending = None  # before the step ends: a later SIGINT is raised at once
        _Deferral.depth -= 1
        if pending:
            _Deferral.pending = None
            _Deferral.previous(*pending)


CRITICAL = critical()
