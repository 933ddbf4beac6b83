"""A shape query's start on a real target: ``ShapeApplier.recover`` reads the
target's progress and has Spark replay a batch its checkpoint logged as done
but the target lacks; an unreachable target is retried with backoff, then fatal."""

from __future__ import annotations

import logging

import psycopg
import pytest

from schemas.config import parse_config
from spark_consumer import job
from spark_consumer.apply_driver import apply_batch
from spark_consumer.job import RECOVER_ATTEMPTS, ShapeApplier
from spark_consumer.progress import ensure_progress
from spark_consumer.target_layout import ensure_table
from tests.helpers import make_config
from tests.integration.test_target_apply import TOPIC, change, items_target, part
from tests.unit.test_checkpoint import names, write_batches
from walbridge.embedded import free_port

GROUP = "g-start"


def applier(target_dsn: str, tmp_path) -> ShapeApplier:
    cfg = parse_config(make_config("postgresql://unused@127.0.0.1:1/x", "127.0.0.1:1", "wb", [{"table": "app.items"}],
                                   consumer={"group": GROUP, "target_dsn": target_dsn,
                                             "checkpoint_dir": str(tmp_path / "ck")}))
    return ShapeApplier(cfg, cfg.shapes[0], items_target(), {"bootstrap.servers": "127.0.0.1:1"})


def test_recover_uncommits_the_batch_the_target_lacks(target_db, tmp_path, caplog):
    ck = tmp_path / "ck" / "app.items"
    # Spark: batch 0 = [0, 3), batch 1 = [3, 6), both logged as done; batch 2 planned.
    write_batches(ck, [{"0": 3}, {"0": 6}, {"0": 9}], committed=1)
    a = applier(str(target_db), tmp_path)
    try:
        with psycopg.connect(target_db, autocommit=True) as conn:
            ensure_progress(conn)
            ensure_table(conn, items_target())
            # The target committed batch 0 only.
            apply_batch(conn, GROUP, items_target(),
                        [part([change("c", 100 + i, off=i, id=i) for i in range(3)])])
        caplog.set_level(logging.INFO, logger="walbridge.consumer")
        a.recover(ck, TOPIC)
        assert names(ck / "commits") == [".0.crc", "0"]  # Spark re-runs batch 1
        assert names(ck / "offsets") == [".0.crc", ".1.crc", "0", "1"]
        assert "batch 1 as done but the target never committed it" in caplog.text
        caplog.clear()
        a.recover(ck, TOPIC)  # batch 0 is in the target: nothing to repair
        assert names(ck / "commits") == [".0.crc", "0"]
        assert "never committed" not in caplog.text
    finally:
        a.close()


def test_recover_retries_an_unreachable_target_then_fails(tmp_path, monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(job.time, "sleep", sleeps.append)
    a = applier(f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere?connect_timeout=2", tmp_path)
    try:
        with pytest.raises(psycopg.OperationalError):
            a.recover(tmp_path / "ck" / "app.items", TOPIC)
        assert sleeps == [2.0, 4.0, 8.0, 16.0][:RECOVER_ATTEMPTS - 1]
    finally:
        a.close()
