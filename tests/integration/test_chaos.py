"""The chaos run, short (issue 16): pgbench on the 5-shape pgbench set while
a seeded schedule injects every fault kind of :mod:`tests.chaos` three times;
afterwards every shape's target equals its source with no manual command, no
row was lost or applied twice, the slot confirmed the final LSN and no
walbridge process exited by itself. The seed is printed; replay a failure
with ``WALBRIDGE_CHAOS_SEED=<seed>``. The long run is ``bench/chaos.py``."""

from __future__ import annotations

import os
import random
import shutil

import pytest

from tests.chaos import FAULTS, Chaos


@pytest.mark.timeout(900)  # the run (~3 min) and two settle waits, each reported if it runs out
def test_faults_in_series_lose_nothing_and_need_no_repair(pg_base_dir, tmp_path):
    seed = int(os.environ.get("WALBRIDGE_CHAOS_SEED") or random.randrange(1 << 31))
    print(f"chaos seed {seed} (replay: WALBRIDGE_CHAOS_SEED={seed})")
    try:
        result = Chaos(pg_base_dir, seed, rounds=3, gap=(2.0, 5.0), rate=20, message_timeout_s=10.0,
                       settle_timeout=300.0).run()
    finally:  # the whole logs, where pytest keeps its last runs' files (the scratch dir goes)
        for log in ("producer.log", "consumer.log"):
            if (pg_base_dir / log).exists():
                shutil.copy(pg_base_dir / log, tmp_path / log)
        print(f"logs: {tmp_path}")
    print(result.table())
    injected = {k: sum(i.kind == k for i in result.injections) for k in FAULTS}
    assert all(n >= 3 for n in injected.values()), injected
    assert not result.problems, f"seed {seed}:\n" + "\n".join(result.problems)
    assert result.lost_rows == 0 and result.duplicate_rows == 0, result.table()
