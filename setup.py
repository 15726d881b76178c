"""The compiled part of the package (the default eviction policy's core); the rest of the
metadata is in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(ext_modules=cythonize([Extension("mlx_moestream._cyclic", ["mlx_moestream/_cyclic.pyx"])],
                            language_level=3))
