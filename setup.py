"""The compiled part of the package (the cores of the `cyclic` and `age` eviction policies); the
rest of the metadata is in pyproject.toml. The module carries the digest of the sources it was
built from, so that a checkout whose sources changed since (a pull) refuses the stale build."""

import sys
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

sys.path.insert(0, str(Path(__file__).parent / "mlx_moestream" / "policies"))
from sources import SOURCE, digest  # noqa: E402  (the package itself needs mlx to import)

# no fused multiply-add: the policies rank keys by the same floats on every machine
setup(ext_modules=cythonize(
    [Extension("mlx_moestream.policies._core", [SOURCE],
               define_macros=[("SOURCE_DIGEST", f'"{digest()}"')],
               extra_compile_args=["-ffp-contract=off"])],
    language_level=3))
