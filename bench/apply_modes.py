"""Apply paths by deploy mode: the driver apply against the staged apply, in
local mode and on a Spark standalone cluster, on the same topic, against a
plain-loop reference measured in the same run.

    flock /tmp/wb-tests.lock .venv/bin/python bench/apply_modes.py [--rows 600000] [--batch 50000] [--repeat 2]

- Topology (``tests/cluster.py``, as the cluster tests have it): PostgreSQL,
  the Tansu broker and a Spark standalone master on this host's end of a veth
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
from walbridge.embedded import PostgresCluster, TansuBroker  # noqa: E402


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
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    warm_from = min(max(args.warmup_batches, 1), args.rows // args.batch) * args.batch
    first = next(m for m in marks if m[1] >= warm_from)
    with psycopg.connect(target) as conn:
        assert conn.execute("SELECT count(*) FROM public.bench_rows").fetchone()[0] == args.rows
    pg.drop_database(name)
    return {"mode": mode, "apply": "staged" if staged else "driver", "round": n,
            "warm_rows_per_s": round((total - first[1]) / (marks[-1][0] - first[0])),
            "cold_total_s": round(marks[-1][0] - t0, 1), "commits": len(marks) - 1}


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
                TansuBroker(base / "kafka", host=ns.host_ip) as broker, \
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
