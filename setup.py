"""Build of walbridge's compiled hot path (``producer._fastcodec``); everything
else is declared in pyproject.toml. The producer runs without the extension
(pure-Python reference path), only slower."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(ext_modules=cythonize(
    [Extension("producer._fastcodec", ["producer/_fastcodec.pyx"], extra_compile_args=["-O2"])],
    compiler_directives={"language_level": "3"},
))
