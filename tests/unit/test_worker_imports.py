"""A Python worker's per-task ``importlib.invalidate_caches()`` re-reads no
unchanged zip archive, and still sees a changed one
(spark_consumer.worker_imports)."""

import importlib
import sys
import zipfile
import zipimport

import pytest

from spark_consumer.worker_imports import keep_zip_directories


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
