"""The compiled part of the package (the default eviction policy's core); the rest of the
metadata is in pyproject.toml. The module carries the digest of the source it was built from,
so that a checkout whose source changed since (a pull) refuses the stale build."""

import hashlib
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

SOURCE = "mlx_moestream/policies/_cyclic.pyx"
digest = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()
setup(ext_modules=cythonize(
    [Extension("mlx_moestream.policies._cyclic", [SOURCE],
               define_macros=[("SOURCE_DIGEST", f'"{digest}"')])],
    language_level=3))
