"""Apply paths by deploy mode: the driver apply against the staged apply, in
local mode and on a Spark standalone cluster, on the same topic, against a
plain-loop reference measured in the same run.

    flock /tmp/wb-tests.lock .venv/bin/python bench/apply_modes.py [--rows 600000] [--batch 50000] [--repeat 2]

- Topology (``tests/cluster.py``, as the cluster tests have it): PostgreSQL,
  the Apache Kafka broker and a Spark standalone master on this host's end of a veth
  pair; one worker (``--worker-cores``) inside a network namespace.
- The producer snapshots ``--rows`` rows (``bench/consumer.py``'s table) into a
  4-partition shape topic once. Reference: the plain confluent-kafka + fastavro
  loop (``bench/consumer.py``), run twice, the faster run counts.
- Each run applies the whole topic into a fresh target database with
  ``max_offsets_per_trigger = --batch``, one of:
  local: ``walbridge consumer -c FILE`` (Spark local[*]);
  cluster: the README's standalone ``spark-submit`` (packed environment).
  Runs alternate modes and apply paths, ``--repeat`` rounds.
- Rows/s are measured warm from the target's progress table (committed with
  the rows): from the first commit at or past ``--warmup-batches`` batches to
  the last commit. Cold total: from start to the last commit.
- CPU per row over the same warm window, by where it is spent: the driver side
  (spark-submit's or walbridge's process group: driver JVM, driver Python,
  Spark's Python planner workers; in local mode the executors too), the
  executors (every process in the namespace: worker, executor JVM, its Python
  workers) and PostgreSQL (the postmaster and its backends). The driver's
  share is what no number of executors can spread: it bounds a mode's
  throughput on a cluster with cores to spare.

This machine has 2 cores: the "cluster's" worker shares them with the driver,
the broker and PostgreSQL, so the cluster runs show where the work lands and
what it costs, not what more cores would add.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.consumer import PARTITIONS, TOPIC, bench_config, fill_topic, make_source, plain_loop  # noqa: E402
from schemas.config import parse_config  # noqa: E402
from tests.cluster import NetworkNamespace, SparkStandalone, readme_commands, user_env  # noqa: E402
from tests.helpers import write_toml  # noqa: E402
from walbridge.embedded import KafkaBroker, PostgresCluster  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def cpu_by_pid(pids) -> dict[int, float]:
    """utime + stime of each live process, in seconds."""
    out = {}
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            out[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def session_pids(sid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (_stat(int(p)) or [None] * 4)[3] == str(sid)]


def postgres_pids(postmaster: int) -> list[int]:
    return [postmaster] + [int(p) for p in os.listdir("/proc") if p.isdigit()
                           and (_stat(int(p)) or [None, None])[1] == str(postmaster)]


def cpu_snapshot(proc: subprocess.Popen, spark: SparkStandalone | None, pg: PostgresCluster) -> dict[str, dict]:
    return {"driver side": cpu_by_pid(session_pids(proc.pid)),
            "executors": cpu_by_pid(spark.netns.pids()) if spark else {},
            "postgresql": cpu_by_pid(postgres_pids(pg.postmaster_pid()))}


def cpu_used(start: dict[str, dict], end: dict[str, dict]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, per side (processes started in between count whole)."""
    return {side: sum(t - start[side].get(pid, 0.0) for pid, t in end[side].items()) for side in end}


def applied(dsn: str, group: str) -> int:
    try:
        with psycopg.connect(dsn) as conn:
            return conn.execute("SELECT coalesce(sum(next_offset), 0)::bigint FROM _walbridge.progress "
                                "WHERE consumer_group = %s", (group,)).fetchone()[0]
    except psycopg.Error:
        return 0


def run_once(mode: str, staged: bool, n: int, pg: PostgresCluster, bootstrap: str, spark: SparkStandalone | None,
             packed: Path, base: Path, args) -> dict:
    name = f"run{n}_{mode}_{'staged' if staged else 'driver'}"
    target = pg.create_database(name)
    run_dir = base / name
    run_dir.mkdir()
    group = f"bench-{name}"
    cfg = bench_config(pg.dsn("postgres"), bootstrap, {
        "group": group, "target_dsn": target, "checkpoint_dir": str(run_dir / "checkpoints"),
        "trigger_interval": 0.2, "max_offsets_per_trigger": args.batch, "staged_apply": staged})
    write_toml(cfg, run_dir / "walbridge.toml")
    if mode == "local":
        cmd, env = [str(Path(sys.executable).parent / "walbridge"), "consumer", "-c", "walbridge.toml"], user_env()
    else:
        for item in ("env", "walbridge-env.tar.gz"):
            (run_dir / item).symlink_to(packed / item)
        cmd = ["bash", "-c", readme_commands()["standalone"]]
        env = user_env(SPARK_MASTER=spark.url, DRIVER_HOST=spark.netns.host_ip, SPARK_CONF_DIR=str(spark.conf_dir))
    total = args.rows + PARTITIONS  # + each partition's snapshot_end
    marks: list[tuple[float, int]] = []
    warm_from = min(max(args.warmup_batches, 1), args.rows // args.batch) * args.batch
    cpu_start = cpu_end = None
    with open(run_dir / "consumer.log", "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while not marks or marks[-1][1] < total:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: the consumer exited; see {run_dir / 'consumer.log'}")
                if time.monotonic() - t0 > args.timeout:
                    raise RuntimeError(f"{name}: not done after {args.timeout}s")
                done = applied(target, group)
                if not marks or done != marks[-1][1]:
                    marks.append((time.monotonic(), done))
                    if cpu_start is None and done >= warm_from:
                        cpu_start = cpu_snapshot(proc, spark if mode == "cluster" else None, pg)
                time.sleep(0.05)
            cpu_end = cpu_snapshot(proc, spark if mode == "cluster" else None, pg)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    first = next(m for m in marks if m[1] >= warm_from)
    with psycopg.connect(target) as conn:
        assert conn.execute("SELECT count(*) FROM public.bench_rows").fetchone()[0] == args.rows
    pg.drop_database(name)
    warm_rows = total - first[1]
    return {"mode": mode, "apply": "staged" if staged else "driver", "round": n,
            "warm_rows_per_s": round(warm_rows / (marks[-1][0] - first[0])),
            "cold_total_s": round(marks[-1][0] - t0, 1), "commits": len(marks) - 1,
            "cpu_us_per_row": {side: round(s * 1e6 / warm_rows, 1) for side, s in cpu_used(cpu_start, cpu_end).items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=600_000)
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--warmup-batches", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", default="local,cluster")
    ap.add_argument("--worker-cores", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "apply_modes.json")
    args = ap.parse_args()
    modes = args.modes.split(",")
    base = Path(tempfile.mkdtemp(prefix="wb-bench-apply-modes-"))
    results: dict = {"rows": args.rows, "batch": args.batch, "warmup_batches": args.warmup_batches, "runs": []}
    try:
        with NetworkNamespace() as ns, \
                PostgresCluster(base / "pg", host=ns.host_ip, trusted_networks=(ns.network,)) as pg, \
                KafkaBroker(base / "kafka", host=ns.host_ip) as broker, \
                SparkStandalone(ns, base / "spark", cores=args.worker_cores) as spark:
            make_source(pg.dsn("postgres"), args.rows)
            fill_topic(parse_config(bench_config(pg.dsn("postgres"), broker.bootstrap, {})))
            results["plain_loop_rows_per_s"] = round(args.rows / min(
                plain_loop(broker.bootstrap, TOPIC, "bench", args.rows) for _ in range(2)))
            print(json.dumps(results), flush=True)
            packed = base / "packed"
            packed.mkdir()
            if "cluster" in modes:
                subprocess.run(["bash", "-euo", "pipefail", "-c", readme_commands()["pack"]], cwd=packed,
                               env=user_env(), check=True, capture_output=True)
            n = 0
            for _ in range(args.repeat):
                for mode in modes:
                    for staged in (False, True):
                        n += 1
                        run = run_once(mode, staged, n, pg, broker.bootstrap, spark, packed, base, args)
                        run["ratio_vs_plain_loop"] = round(run["warm_rows_per_s"] / results["plain_loop_rows_per_s"], 3)
                        results["runs"].append(run)
                        print(json.dumps(run), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
