"""The Avro contract shared by the producer and the consumer.

Fixed parts live here as ``.avsc`` files (the ``Source`` block of every
envelope); per-shape row, key and envelope schemas are built from the source
table's columns by :mod:`producer.envelope`, embedding these fixed parts.
"""

import json
from functools import cache
from importlib import resources


@cache
def load(name: str) -> dict:
    """A fixed schema by file stem, e.g. ``load("source")``."""
    return json.loads(resources.files(__name__).joinpath(f"{name}.avsc").read_text())
