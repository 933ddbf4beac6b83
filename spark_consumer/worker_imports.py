"""Executor side: a Python worker's per-task import cost, kept to the first task.

Before every task PySpark's worker calls ``importlib.invalidate_caches()``
(Spark 4.1; SPARK-54744 calls it only when a task adds a path). On Python
3.10 and 3.11 that makes every ``zipimporter`` re-read its archive's whole
directory at once (python/cpython#103200, made lazy in 3.12): pyspark.zip,
py4j's zip and spark-core's jar (5,358 entries), once per package imported
from them. Measured here: 0.09–0.10 s a task on a quiet machine, paid by
every decode task of every micro-batch.

Invariant: an archive is re-read when its size or modification time changed
since this importer last read it, as before; an unchanged one is not. (The
archives a worker imports from do not change while it lives.)
"""

from __future__ import annotations

import os
import sys
import zipimport

_STAMP = "_walbridge_stamp"  # an importer's archive (mtime, size) when it last read it


def keep_zip_directories() -> None:
    """Make ``zipimporter.invalidate_caches`` skip unchanged archives in this
    process (no-op on Python 3.12+, where it is lazy, and when done already)."""
    if sys.version_info >= (3, 12) or getattr(zipimport.zipimporter.invalidate_caches, "keeps", False):
        return
    reread = zipimport.zipimporter.invalidate_caches

    def invalidate_caches(self: zipimport.zipimporter) -> None:
        try:
            st = os.stat(self.archive)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp is None or getattr(self, _STAMP, None) != stamp:
            reread(self)
            setattr(self, _STAMP, stamp)

    invalidate_caches.keeps = True
    zipimport.zipimporter.invalidate_caches = invalidate_caches
