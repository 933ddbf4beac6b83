"""Producer benchmark: WAL → Avro → Kafka-acked rows/s against ``pg_recvlogical``
reading the same WAL in the same run, plus the producer's memory while one huge
transaction streams through.

    .venv/bin/python bench/producer.py [--rows 1000000] [--pgbench-seconds 30] [--big-rows 10000000]
                                       [--full-rows 1000000]

Method (every number is a ratio against a reference measured in this run):
- One embedded PostgreSQL and one Apache Kafka broker. A table is published; the
  walbridge slot (created by the producer, which is then stopped) and a
  reference slot for ``pg_recvlogical`` start at the same LSN.
- A workload is written while neither reader runs, so both later decode exactly
  the same WAL: (a) a bulk INSERT of N rows then a bulk UPDATE of the N rows,
  (b) a pgbench tpcb run, (c) as (a) on a REPLICA IDENTITY FULL table whose
  one shape has a row filter (every row passes it: each UPDATE carries the old
  row, both are filtered, and the change is sent with its ``before``).
- Each reader then catches up alone (the machine has 2 cores): pg_recvlogical
  with ``--endpos`` writing to /dev/null; the walbridge producer until the slot's
  confirmed_flush_lsn reaches the same end (``[ack] consumer_groups = []``: the
  producer confirms only what Kafka acknowledged). Times include each reader's
  start-up; the producer's start-up (imports, connections, tail reads) is also
  reported on its own.
- Memory: the producer as a process; its RSS is sampled while one transaction of
  ``--big-rows`` rows streams through, compared with its RSS when idle and caught up.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from producer.pgoutput import lsn_to_int  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster, find_pg_bin  # noqa: E402

# Workload (c): every row passes the filter, so each change is filtered (old and new row) and sent.
FILTERED_SHAPE = """
[[shapes]]
table = "public.bench_full"
name = "bench_full_filtered"
where = "a > 0 AND b IS NOT NULL"
"""


def lsn(conn) -> int:
    return lsn_to_int(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])


def confirmed(conn, slot: str) -> int:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)).fetchone()
    return lsn_to_int(row[0]) if row and row[0] else 0


def write_config(path: Path, dsn: str, bootstrap: str, tables: list[str], extra_shapes: str = "") -> Path:
    shapes = "\n".join(f'[[shapes]]\ntable = "{t}"\n' for t in tables) + extra_shapes
    path.write_text(f"""
[source]
dsn = "{dsn}"
slot = "wb_bench"
publication = "wb_bench"
[kafka]
bootstrap_servers = "{bootstrap}"
topic_prefix = "bench"
partitions = 4
[ack]
consumer_groups = []
{shapes}
""")
    return path


class ProducerProc:
    def __init__(self, config: Path, log: Path):
        self.log = log
        self._log_start = len(log.read_text(errors="replace")) if log.exists() else 0
        self.proc = subprocess.Popen([sys.executable, "-m", "walbridge.cli", "producer", "-c", str(config)],
                                     cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        self.peak_rss = 0
        self._sampling = True
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def rss(self) -> int:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except FileNotFoundError:
            pass
        return 0

    def _sample(self) -> None:
        while self._sampling and self.proc.poll() is None:
            self.peak_rss = max(self.peak_rss, self.rss())
            time.sleep(0.05)

    def wait_streaming(self, timeout: float = 120) -> float:
        start = time.monotonic()
        while "streaming from slot" not in self.log.read_text(errors="replace")[self._log_start:]:
            if self.proc.poll() is not None or time.monotonic() - start > timeout:
                raise RuntimeError("producer did not start:\n" + self.log.read_text()[-3000:])
            time.sleep(0.02)
        return time.monotonic() - start

    def stop(self) -> None:
        self._sampling = False
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def catch_up_walbridge(conn, config: Path, log: Path, end: int) -> tuple[float, float, int]:
    """(seconds to confirm ``end``, of which start-up, peak RSS)."""
    t0 = time.monotonic()
    proc = ProducerProc(config, log)
    startup = proc.wait_streaming()
    while confirmed(conn, "wb_bench") < end:
        if proc.proc.poll() is not None:
            raise RuntimeError("producer died:\n" + log.read_text()[-3000:])
        time.sleep(0.01)
    elapsed = time.monotonic() - t0
    proc.stop()
    return elapsed, startup, proc.peak_rss


def catch_up_recvlogical(pg_bin: Path, dsn: str, end: int) -> float:
    t0 = time.monotonic()
    subprocess.run([str(pg_bin / "pg_recvlogical"), "-d", dsn, "--slot", "ref", "--start", "--no-loop",
                    "-o", "proto_version=1", "-o", "publication_names=wb_bench", "-f", "/dev/null",
                    "-E", f"{end >> 32:X}/{end & 0xFFFFFFFF:X}"], check=True)
    return time.monotonic() - t0


def catch_up_both(conn, pg_bin: Path, dsn: str, config: Path, log: Path, changes: int, **facts) -> dict:
    """Each reader catches up alone on the WAL written so far; their rates and ratio."""
    end = lsn(conn)
    t_ref = catch_up_recvlogical(pg_bin, dsn, end)
    t_wb, startup, _ = catch_up_walbridge(conn, config, log, end)
    result = {**facts, "changes": changes, "pg_recvlogical_s": round(t_ref, 2), "walbridge_s": round(t_wb, 2),
              "walbridge_startup_s": round(startup, 2), "pg_recvlogical_rows_per_s": round(changes / t_ref),
              "walbridge_rows_per_s": round(changes / t_wb), "ratio": round(t_ref / t_wb, 3),
              "ratio_excluding_startup": round(t_ref / max(t_wb - startup, 1e-9), 3)}
    print(json.dumps(result), flush=True)
    return result


def pgbench_init(pg_bin: Path, dsn: str, scale: int) -> None:
    subprocess.run([str(pg_bin / "pgbench"), "-i", "-q", "-s", str(scale), dsn], check=True, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--pgbench-seconds", type=int, default=30)
    ap.add_argument("--pgbench-scale", type=int, default=10)
    ap.add_argument("--big-rows", type=int, default=10_000_000)
    ap.add_argument("--full-rows", type=int, default=1_000_000, help="rows of workload (c); 0 skips it")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "producer.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="wb-bench-"))
    pg_bin = find_pg_bin()
    results: dict = {"args": vars(args) | {"out": str(args.out)}}
    with PostgresCluster(base / "pg") as pg, KafkaBroker(base / "kafka") as broker:
        dsn = pg.dsn("postgres")
        config = write_config(base / "wb.toml", dsn, broker.bootstrap,
                              ["public.bench_rows", "public.pgbench_accounts", "public.pgbench_branches",
                               "public.pgbench_tellers", "public.pgbench_history", "public.big"],
                              FILTERED_SHAPE)
        log = base / "producer.log"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_rows (id int PRIMARY KEY, a int, b text, c numeric(12,2),"
                         " d timestamptz)")
            conn.execute("CREATE TABLE big (id int PRIMARY KEY, v int)")
            conn.execute("CREATE TABLE bench_full (id int PRIMARY KEY, a int, b text, c numeric(12,2),"
                         " d timestamptz)")
            conn.execute("ALTER TABLE bench_full REPLICA IDENTITY FULL")
            pgbench_init(pg_bin, dsn, args.pgbench_scale)
            conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
            # Let the producer create its slot, snapshot pgbench's initial tables, then stop.
            end = lsn(conn)
            elapsed, startup, _ = catch_up_walbridge(conn, config, log, end)
            results["initial_snapshot_s"] = round(elapsed, 2)
            conn.execute("SELECT pg_create_logical_replication_slot('ref', 'pgoutput')")

            # (a) bulk INSERT + UPDATE of N rows.
            conn.execute(f"INSERT INTO bench_rows SELECT g, g, md5(g::text), g / 7.0, now()"
                         f" FROM generate_series(1, {args.rows}) g")
            conn.execute("UPDATE bench_rows SET a = a + 1")
            results["bulk"] = catch_up_both(conn, pg_bin, dsn, config, log, 2 * args.rows)

            # (c) a filtered shape on a REPLICA IDENTITY FULL table: bulk INSERT + UPDATE of N rows.
            if args.full_rows:
                conn.execute(f"INSERT INTO bench_full SELECT g, g, md5(g::text), g / 7.0, now()"
                             f" FROM generate_series(1, {args.full_rows}) g")
                conn.execute("UPDATE bench_full SET a = a + 1")
                results["filtered_full"] = catch_up_both(conn, pg_bin, dsn, config, log, 2 * args.full_rows)

            # (b) pgbench tpcb.
            start_counts = conn.execute("SELECT count(*) FROM pgbench_history").fetchone()[0]
            subprocess.run([str(pg_bin / "pgbench"), "-n", "-c", "4", "-j", "2", "-T", str(args.pgbench_seconds),
                            dsn], check=True, capture_output=True)
            txs = conn.execute("SELECT count(*) FROM pgbench_history").fetchone()[0] - start_counts
            # tpcb: 3 UPDATEs + 1 INSERT per transaction
            results["pgbench"] = catch_up_both(conn, pg_bin, dsn, config, log, txs * 4, transactions=txs)
            conn.execute("SELECT pg_drop_replication_slot('ref')")

            # (c) memory while one huge transaction streams through.
            if args.big_rows:
                proc = ProducerProc(config, log)
                proc.wait_streaming()
                time.sleep(3)
                idle = proc.rss()
                proc.peak_rss = idle
                conn.execute(f"INSERT INTO big SELECT g, 0 FROM generate_series(1, {args.big_rows}) g")
                end = lsn(conn)
                t0 = time.monotonic()
                while confirmed(conn, "wb_bench") < end:
                    if proc.proc.poll() is not None:
                        raise RuntimeError("producer died:\n" + log.read_text()[-3000:])
                    time.sleep(0.05)
                streamed = time.monotonic() - t0
                proc.stop()
                results["big_transaction"] = {"rows": args.big_rows, "idle_rss_mb": round(idle / 2**20, 1),
                                              "peak_rss_mb": round(proc.peak_rss / 2**20, 1),
                                              "peak_over_idle": round(proc.peak_rss / idle, 2),
                                              "stream_s": round(streamed, 1),
                                              "rows_per_s": round(args.big_rows / streamed)}
                print(json.dumps(results["big_transaction"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
