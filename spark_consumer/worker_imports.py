"""Executor side: a Python worker's fixed costs per task, paid once per
worker process instead (:func:`settle_worker`, called by every decode task).

Two costs PySpark's worker pays around every task, measured here:
- Before every task it calls ``importlib.invalidate_caches()`` (Spark 4.1;
  SPARK-54744 calls it only when a task adds a path). On Python 3.10 and
  3.11 that makes every ``zipimporter`` re-read its archive's whole directory
  at once (python/cpython#103200, made lazy in 3.12): pyspark.zip, py4j's zip
  and spark-core's jar (5,358 entries), once per package imported from them.
  0.09-0.10 s a task on a quiet machine.
- After every task a reused worker runs a full ``gc.collect()``
  (``pyspark/daemon.py``), which walks every object the process holds:
  PySpark, pyarrow, fastavro and walbridge's modules, ~110,000 objects,
  50-56 ms a task on a quiet machine (bench/RESULTS.md, "The Python workers'
  collection after every task").

Invariants:
- A zip archive is re-read when its size or modification time changed since
  this importer last read it, as before; an unchanged one is not. (The
  archives a worker imports from do not change while it lives.)
- In a worker the daemon reuses (``SPARK_REUSE_WORKER``, Spark's
  ``spark.python.worker.reuse``, on by default), what the worker holds when
  its first decode task starts (its modules) is frozen once, after one full
  collection, so no garbage is frozen with it and the daemon's collection
  after each task walks only what tasks made since. A worker that is not
  reused runs no such collection, so it freezes nothing.
- A frozen object is still freed when its last reference goes; only a
  reference cycle among them would outlive its use, and modules make none
  that the worker drops.
"""

from __future__ import annotations

import gc
import os
import sys
import zipimport

_STAMP = "_walbridge_stamp"  # an importer's archive (mtime, size) when it last read it
REUSED = "SPARK_REUSE_WORKER"  # set (non-empty) by Spark for workers its daemon reuses (pyspark/daemon.py)
_settled = False  # has this process frozen what it held at its first decode task


def settle_worker() -> None:
    """Once per worker process: keep unchanged zip directories
    (:func:`keep_zip_directories`) and freeze what the process holds, out of
    the collection PySpark's daemon runs after every task."""
    global _settled
    keep_zip_directories()
    if not _settled and os.environ.get(REUSED):
        gc.collect()
        gc.freeze()
        _settled = True


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
