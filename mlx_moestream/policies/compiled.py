"""The compiled policy cores (`_cyclic.pyx`, `_age.pyx`, beside this file), each checked against
its source.

The only module that imports them, and only when a compiled policy is asked for, so that the
other policies work without a build.
"""

from __future__ import annotations

import hashlib
from importlib import import_module
from pathlib import Path
from types import ModuleType


def load(name: str) -> ModuleType:
    """The compiled module `name` (`_cyclic`, `_age`), refused if built from other source than
    the one beside this file.

    After a pull that changed the source, or with another checkout's build found through a
    shared environment, it would run other code than the source reads. A wheel has no source.
    """
    try:
        module = import_module(f"{__package__}.{name}")
    except ModuleNotFoundError:  # a checkout used as it is
        raise ImportError(f"mlx_moestream's compiled part ({name}.pyx) is not built: run "
                          "`pip install -e .` in the checkout") from None
    source = Path(__file__).with_name(f"{name}.pyx")
    if (source.exists()
            and hashlib.sha256(source.read_bytes()).hexdigest() != module.SOURCE_DIGEST):
        raise ImportError(f"{source} is not the source of mlx_moestream's compiled part "
                          f"({module.__file__}): run `pip install -e .` in this checkout")
    return module
