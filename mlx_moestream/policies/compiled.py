"""The compiled policy cores (`_core.pyx`, beside this file, with the files it includes), checked
against their sources.

The only module that imports them, and only when a compiled policy is asked for, so that the
other policies work without a build.
"""

from __future__ import annotations

from importlib import import_module

from . import sources

try:  # `from . import _core` would raise a plain ImportError, as for a name the package lacks
    core = import_module("._core", __package__)
except ModuleNotFoundError:  # a checkout used as it is
    raise ImportError("mlx_moestream's compiled part (_core.pyx) is not built: run "
                      "`pip install -e .` in the checkout") from None


def _check_build() -> None:
    """Refuse a compiled part built from other sources than the ones beside this file.

    After a pull that changed them, or with another checkout's build found through a shared
    environment, it would run other code than the sources read. A wheel has no sources.
    """
    found = sources.digest()
    if found and found != core.SOURCE_DIGEST:
        raise ImportError(f"{sources.FOLDER / '_core.pyx'} and the files it includes are not the "
                          f"source of mlx_moestream's compiled part ({core.__file__}): run "
                          "`pip install -e .` in this checkout")


_check_build()
