"""The Avro contract shared by the producer and the consumer.

Fixed parts live here as ``.avsc`` files (the ``Source`` block of every
envelope); per-shape row, key and envelope schemas are built from the source
table's columns by :mod:`producer.envelope`, embedding these fixed parts.
"""

import importlib
import json
import os
from functools import cache
from importlib import resources
from types import ModuleType


@cache
def load(name: str) -> dict:
    """A fixed schema by file stem, e.g. ``load("source")``."""
    return json.loads(resources.files(__name__).joinpath(f"{name}.avsc").read_text())


def compiled_extension(module: str) -> ModuleType | None:
    """The compiled codec ``module`` (e.g. ``"producer._fastcodec"``), or None
    when it is not built (a source tree without ``pip install``) or
    ``WALBRIDGE_PURE_PYTHON`` is set: its caller then takes the pure-Python
    reference path."""
    if os.environ.get("WALBRIDGE_PURE_PYTHON"):
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
