"""Build of walbridge's compiled hot paths (``producer._fastcodec``, the
producer's encoder; ``spark_consumer._fastdecode``, the executors' envelope
reader); everything else is declared in pyproject.toml. Both sides run without
the extensions (pure-Python/fastavro reference paths), only slower."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(ext_modules=cythonize(
    [Extension("producer._fastcodec", ["producer/_fastcodec.pyx"], extra_compile_args=["-O2"]),
     Extension("spark_consumer._fastdecode", ["spark_consumer/_fastdecode.pyx"], extra_compile_args=["-O2"])],
    compiler_directives={"language_level": "3"},
))
