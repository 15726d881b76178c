"""Ctrl-C never splits a cache decision from the read that fulfils it.

Between giving an expert a slot and filling that slot, an interrupt would leave the expert
marked resident over another expert's bytes, and every later token could be wrong. The runtime
runs such steps inside `critical()`: a SIGINT that arrives there is delivered when the step
ends, a few milliseconds later, wherever the caller expects it (`chat` goes on with the same
model). Signals reach only the main thread, so only its steps defer them. A handler set after
ours (Jupyter sets one before every cell) is swapped out for the step, ours standing in.
The Python handlers of the other signals a program catches to stop work (`DEFERRED`: a
harness's SIGALRM timeout, a server's SIGTERM) wait the same way: raised inside a step, they
left the cache's bookkeeping half done, and every later call failed.
"""

from __future__ import annotations

import _signal  # `signal.getsignal` without its enum conversion (see `critical`)
import signal
import threading

_MAIN = threading.main_thread().ident
# SIGINT first: its handler is ours between steps too (`install_handler`); the others' are
# swapped for ours only during a step, and only where a Python handler is set
DEFERRED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM",
                                                   "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


class _Deferral:
    depth = 0  # critical steps the main thread is inside
    pending: list[int] = []  # signals that arrived inside one, raised again at its end
    previous = None  # the SIGINT handler ours wraps
    replaced: dict = {}  # per signal, the handler swapped out for the current step


def install_handler() -> None:
    """Route SIGINT through the deferral. Only from the main thread, and only over a Python
    handler (the default raises KeyboardInterrupt); a handler set later replaces ours but for
    critical steps."""
    if threading.get_ident() != _MAIN:
        return
    current = _signal.getsignal(signal.SIGINT)
    if current is _on_signal or not callable(current):
        return
    _Deferral.previous = current
    signal.signal(signal.SIGINT, _on_signal)


def _on_signal(signum, frame) -> None:
    if _Deferral.depth:
        if signum not in _Deferral.pending:
            _Deferral.pending.append(signum)
    else:  # SIGINT between steps (others are ours only during one)
        _Deferral.replaced.get(signum, _Deferral.previous)(signum, frame)


class critical:
    """A step that must finish once started: the signals of `DEFERRED` wait for its end.
    Entered on every layer call, right after the host waited for the device, when the code a
    step runs has left the CPU caches: handlers are read with `_signal.getsignal`, which
    returns them as they are (0.1 us then; `signal.getsignal` looks up an enum for it, 10 us
    then)."""

    __slots__ = ()

    def __enter__(self) -> None:
        if threading.get_ident() != _MAIN:
            return
        if not _Deferral.depth:
            for signum in DEFERRED:
                current = _signal.getsignal(signum)
                if current is not _on_signal and callable(current):
                    _Deferral.replaced[signum] = current  # first: a signal from here on reaches it
                    signal.signal(signum, _on_signal)
        _Deferral.depth += 1

    def __exit__(self, *exc) -> None:
        if threading.get_ident() != _MAIN:
            return
        if _Deferral.depth > 1:
            _Deferral.depth -= 1
            return
        _Deferral.depth = 0
        replaced, pending = _Deferral.replaced, _Deferral.pending
        if replaced:
            for signum, handler in replaced.items():
                signal.signal(signum, handler)
            _Deferral.replaced = {}
        if pending:
            _Deferral.pending = []
            _deliver(sorted(pending, key=lambda signum: signum != signal.SIGINT))


def _deliver(signals: list[int]) -> None:
    """Raise each signal again, now that its handler is back: every handler runs, also after
    one raised, and the last one's exception propagates (SIGINT goes first: the others end
    the program)."""
    try:
        signal.raise_signal(signals[0])
    finally:
        if len(signals) > 1:
            _deliver(signals[1:])


CRITICAL = critical()
