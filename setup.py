"""The compiled part of the package (the cores of the `cyclic` and `age` eviction policies); the
rest of the metadata is in pyproject.toml. Each module carries the digest of the source it was
built from, so that a checkout whose source changed since (a pull) refuses the stale build."""

import hashlib
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup


def extension(name: str) -> Extension:
    source = f"mlx_moestream/policies/{name}.pyx"
    digest = hashlib.sha256((Path(__file__).parent / source).read_bytes()).hexdigest()
    # no fused multiply-add: a policy ranks keys by the same floats on every machine
    return Extension(f"mlx_moestream.policies.{name}", [source],
                     define_macros=[("SOURCE_DIGEST", f'"{digest}"')],
                     extra_compile_args=["-ffp-contract=off"])


setup(ext_modules=cythonize([extension("_cyclic"), extension("_age")], language_level=3))
