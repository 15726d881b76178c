"""Ctrl-C never splits a cache decision from the read that fulfils it.

Between giving an expert a slot and filling that slot, an interrupt would leave the expert
marked resident over another expert's bytes, and every later token could be wrong. The runtime
runs such steps inside `critical()`: a SIGINT that arrives there is delivered when the step
ends, a few milliseconds later, wherever the caller expects it (`chat` goes on with the same
model). Signals reach only the main thread, so only its steps defer them. A handler set after
ours (Jupyter sets one before every cell) is swapped out for the step, ours standing in.
Other signals that end a session (`chat`'s SIGTERM) wait the same way through `deferred`.
"""

from __future__ import annotations

import _signal  # `signal.getsignal` without its enum conversion (see `critical`)
import signal
import threading
from typing import Callable

_MAIN = threading.main_thread().ident


class _Deferral:
    depth = 0  # critical steps the main thread is inside
    pending: tuple | None = None  # (signum, frame) of a SIGINT that arrived inside one
    other: tuple | None = None  # (handler, signum, frame) of another signal (see `deferred`)
    previous = None  # the handler ours wraps
    replaced = None  # a handler set after ours, swapped out for the current step


def install_handler() -> None:
    """Route SIGINT through the deferral. Only from the main thread, and only over a Python
    handler (the default raises KeyboardInterrupt); a handler set later replaces ours but for
    critical steps."""
    if threading.get_ident() != _MAIN:
        return
    current = _signal.getsignal(signal.SIGINT)
    if current is _on_sigint or not callable(current):
        return
    _Deferral.previous = current
    signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum, frame) -> None:
    if _Deferral.depth:
        _Deferral.pending = (signum, frame)
    else:
        (_Deferral.replaced or _Deferral.previous)(signum, frame)


def deferred(handler: Callable) -> Callable:
    """`handler` as a signal handler that, like SIGINT's, waits for the end of a critical step:
    for a signal whose handler raises. (Python runs handlers in the main thread.)"""
    def on_signal(signum, frame) -> None:
        if _Deferral.depth:
            _Deferral.other = (handler, signum, frame)
        else:
            handler(signum, frame)

    return on_signal


class critical:
    """A step that must finish once started: SIGINT waits for its end. Entered on every
    layer call, right after the host waited for the device, when the code a step runs has left
    the CPU caches: the handler is read with `_signal.getsignal`, which returns it as it is
    (0.1 us then; `signal.getsignal` looks up an enum for it, 10 us then)."""

    __slots__ = ()

    def __enter__(self) -> None:
        if threading.get_ident() != _MAIN:
            return
        if not _Deferral.depth:
            current = _signal.getsignal(signal.SIGINT)
            if current is not _on_sigint and callable(current):
                _Deferral.replaced = current  # first: a SIGINT from here on reaches it
                signal.signal(signal.SIGINT, _on_sigint)
        _Deferral.depth += 1

    def __exit__(self, *exc) -> None:
        if threading.get_ident() != _MAIN:
            return
        if _Deferral.depth > 1:
            _Deferral.depth -= 1
            return
        pending, _Deferral.pending = _Deferral.pending, None  # a later SIGINT is raised at once
        other, _Deferral.other = _Deferral.other, None
        _Deferral.depth = 0
        handler = _Deferral.replaced or _Deferral.previous
        if _Deferral.replaced is not None:
            signal.signal(signal.SIGINT, handler)
            _Deferral.replaced = None
        if other:  # it ends the session: first
            other[0](*other[1:])
        if pending:
            handler(*pending)


CRITICAL = critical()
