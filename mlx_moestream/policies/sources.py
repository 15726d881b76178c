"""Where the compiled policy cores' sources are and their digest: setup.py builds the digest
into the module, compiled.py checks it against the sources beside it. Standard library only:
setup.py imports this file alone."""

from __future__ import annotations

import hashlib
from pathlib import Path

FOLDER = Path(__file__).parent
SOURCE = "mlx_moestream/policies/_core.pyx"  # the module; it includes the `_core_*.pxi` files


def files() -> list[Path]:
    """The module's source and the files it includes, in name order."""
    return sorted(p for p in FOLDER.glob("_core*") if p.suffix in (".pyx", ".pxi"))


def digest() -> str:
    """sha256 of the sources, in name order; '' where there are none (a wheel)."""
    found = files()
    return hashlib.sha256(b"".join(p.read_bytes() for p in found)).hexdigest() if found else ""
