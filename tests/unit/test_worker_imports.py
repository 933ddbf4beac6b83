"""A Python worker's per-task fixed costs, paid once per process
(spark_consumer.worker_imports): its ``importlib.invalidate_caches()`` re-reads
no unchanged zip archive (and still sees a changed one), and what it holds is
frozen once, out of the daemon's collection after every task."""

import importlib
import os
import subprocess
import sys
import textwrap
import zipfile
import zipimport
from pathlib import Path

import pytest

from spark_consumer.worker_imports import REUSED, keep_zip_directories


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12+ re-reads zip archives lazily itself")
def test_an_unchanged_archive_is_not_re_read_and_a_changed_one_is(tmp_path, monkeypatch):
    archive = tmp_path / "lib.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("wbzipped_one.py", "VALUE = 1\n")
    monkeypatch.syspath_prepend(str(archive))
    monkeypatch.setattr(zipimport.zipimporter, "invalidate_caches", zipimport.zipimporter.invalidate_caches)
    reads = []
    real_read = zipimport._read_directory
    monkeypatch.setattr(zipimport, "_read_directory", lambda path: reads.append(path) or real_read(path))
    assert importlib.import_module("wbzipped_one").VALUE == 1

    keep_zip_directories()
    keep_zip_directories()  # twice: still one wrapper
    importlib.invalidate_caches()  # the first one reads (it has no stamp yet)
    reads.clear()
    for _ in range(3):
        importlib.invalidate_caches()
    assert str(archive) not in reads

    with zipfile.ZipFile(archive, "a") as z:
        z.writestr("wbzipped_two.py", "VALUE = 2\n")
    importlib.invalidate_caches()
    assert str(archive) in reads
    assert importlib.import_module("wbzipped_two").VALUE == 2
    for name in ("wbzipped_one", "wbzipped_two"):
        sys.modules.pop(name, None)


def _in_worker_process(script: str, reused: bool) -> subprocess.CompletedProcess:
    """``script`` in a process of its own (freezing is process-wide), as a
    worker the daemon reuses or not."""
    env = {k: v for k, v in os.environ.items() if k != REUSED}
    if reused:
        env[REUSED] = "1"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2], env=env)


def test_a_reused_worker_freezes_what_it_holds_once_and_no_garbage_with_it():
    done = _in_worker_process("""
        import gc, weakref
        from spark_consumer.worker_imports import settle_worker

        class Node:
            pass

        garbage = Node(); garbage.me = garbage  # a cycle only a collection frees
        dropped = weakref.ref(garbage)
        del garbage
        settle_worker()
        frozen = gc.get_freeze_count()
        assert frozen > 1000, frozen  # the modules
        assert dropped() is None  # collected before the freeze, not frozen
        after_task = Node(); after_task.me = after_task  # a task's cycle, made after
        later = weakref.ref(after_task)
        del after_task
        settle_worker()  # the next task: nothing frozen again
        assert gc.get_freeze_count() == frozen, (gc.get_freeze_count(), frozen)
        gc.collect()  # the daemon's, after the task
        assert later() is None  # a task's garbage is still collected
        print("ok")
    """, reused=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_worker_that_is_not_reused_freezes_nothing():
    # Its daemon runs no collection after the task, so a freeze would buy nothing.
    done = _in_worker_process("""
        import gc
        from spark_consumer.worker_imports import settle_worker
        settle_worker()
        print(gc.get_freeze_count())
    """, reused=False)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr
