"""A child forked while a model is loaded (a server's preloaded workers, multiprocessing) streams.

The fork waits for a layer call in progress, so no decision is half made in the child; the
child then starts what did not come along (the I/O threads) and forgets the reads that never
land there.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Callable, Protocol


class Forkable(Protocol):
    lock: threading.RLock  # held by a layer call: the fork waits for it

    def forked(self) -> None:
        """In the child, the lock held: make the model stream there."""


def follow_forks(owner: Forkable) -> None:
    """Hold `owner.lock` across every fork while `owner` lives, and call `owner.forked()` in
    the child. Held weakly: the hooks of a model dropped do nothing."""
    ref = weakref.ref(owner)

    def hook(action: Callable[[Forkable], object]) -> Callable[[], None]:
        def call() -> None:
            live = ref()
            if live is not None:
                action(live)
        return call

    def in_child(live: Forkable) -> None:
        try:
            live.forked()
        finally:
            live.lock.release()

    os.register_at_fork(before=hook(lambda live: live.lock.acquire()),
                        after_in_parent=hook(lambda live: live.lock.release()),
                        after_in_child=hook(in_child))
