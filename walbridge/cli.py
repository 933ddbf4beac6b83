"""``walbridge`` command line: the operator's entry point to every part.

Invariants:
- The config is loaded and validated before any command touches a database or a
  broker; a bad config exits with status 2 and a message naming each bad key.
- A missing optional extra (the Spark consumer without pyspark) is one line
  saying how to install it, exit status 2, before anything starts.
- Secrets are never printed (DSNs go through ``redact_dsn``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from producer.backfill_requests import request_backfill
from schemas.config import ConfigError, load_config
from walbridge.pack import pack
from walbridge.reconcile import reconcile, wait_for
from walbridge.render import render_status, render_verify, verify_details
from walbridge.runtime import MissingExtra, consumer_service, producer_service, setup_logging, stop_on_signals
from walbridge.status import collect_status
from walbridge.up import run_up
from walbridge.verify import as_json, verify


def cmd_producer(args) -> int:
    config = load_config(args.config)
    producer_service(config, stop_on_signals())
    return 0


def cmd_up(args) -> int:
    config = load_config(args.config) if args.config else None
    rate = args.rate if args.rate is not None else (0.0 if config else 20.0)
    run_up(config, Path(args.data_dir), args.duration, rate, headless=args.headless)
    return 0


def cmd_verify(args) -> int:
    config = load_config(args.config)
    diffs = verify(config, args.shape or None)
    if args.json:
        print(json.dumps(as_json(diffs), indent=2, default=str))
    else:
        console = Console()
        console.print(render_verify(diffs))
        for line in verify_details(diffs):
            console.print(line)
    return 0 if all(d.ok for d in diffs) else 1


def cmd_status(args) -> int:
    config = load_config(args.config)
    status = collect_status(config)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        Console().print(render_status(status))
    return 0


def cmd_consumer(args) -> int:
    config = load_config(args.config)
    consumer_service(config, args.master, stop_on_signals())
    return 0


def cmd_backfill(args) -> int:
    config = load_config(args.config)
    try:
        rid = request_backfill(config, args.shape)
    except ValueError as e:
        print(f"walbridge: {e}", file=sys.stderr)
        return 2
    print(f"backfill of shape {args.shape} requested: {rid}")
    if args.wait:
        wait_for(config, [rid], args.timeout)
    return 0


def cmd_reconcile(args) -> int:
    config = load_config(args.config)
    unknown = [s for s in args.shape or () if s not in {c.shape_name for c in config.shapes}]
    if unknown:
        print(f"walbridge: no shape named {', '.join(unknown)} in the config", file=sys.stderr)
        return 2
    console = Console()
    before, after = reconcile(config, args.shape or None, wait=not args.no_wait, timeout=args.timeout,
                              on_progress=console.print)
    final = after if after is not None else before
    console.print(render_verify(final))
    return 0 if all(d.ok for d in final) or (after is None and args.no_wait) else 1


def cmd_pack(args) -> int:
    try:
        out = pack(Path(args.output), args.python_prefix, args.force)
    except FileExistsError as e:
        print(f"walbridge pack: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"walbridge pack: installing into the new environment failed (exit status {e.returncode}); "
              "pip's output is above", file=sys.stderr)
        return 1
    print(out)
    return 0


def cmd_check(args) -> int:
    config = load_config(args.config)
    print(f"config ok: {len(config.shapes)} shape(s): " + ", ".join(s.shape_name for s in config.shapes))
    return 0


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="walbridge", description="PostgreSQL → Kafka (Avro, by shape) → Spark CDC")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("producer", help="stream PostgreSQL changes into the shape topics")
    p.add_argument("-c", "--config", required=True)
    p.set_defaults(func=cmd_producer)
    p = sub.add_parser("consumer", help="the Spark consumer (local[*]): apply the shape topics to the target")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--master", default="local[*]", help="Spark master URL")
    p.set_defaults(func=cmd_consumer)
    p = sub.add_parser("up", help="run the whole pipeline with a live view (embedded default without -c)")
    p.add_argument("-c", "--config", help="your own config; omit for the embedded demo")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--rate", type=float, help="demo workload transactions/s (default 20 embedded, 0 with -c)")
    p.add_argument("--data-dir", default=".walbridge/up", help="where embedded data and logs live")
    p.add_argument("--headless", action="store_true", help="no live view; print the final view")
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("verify", help="compare every shape's target table with the source")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--shape", action="append", help="only this shape (repeatable)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("status", help="slot, writers, consumer groups and producer state")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("backfill", help="re-read a shape from a fresh snapshot while streaming goes on")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--shape", required=True, help="the shape's name")
    p.add_argument("--wait", action="store_true", help="follow it until the consumer has applied it")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.set_defaults(func=cmd_backfill)
    p = sub.add_parser("reconcile", help="verify, backfill the key buckets that differ, verify again")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--shape", action="append", help="only this shape (repeatable)")
    p.add_argument("--no-wait", action="store_true", help="request the backfills and exit")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.set_defaults(func=cmd_reconcile)
    p = sub.add_parser("pack", help="build the Spark consumer's Python environment as one archive, "
                                    "for spark-submit --archives ENV.tar.gz#env on a cluster")
    p.add_argument("-o", "--output", default="walbridge-env.tar.gz", help="archive to write (.tar.gz, .zip, ...)")
    p.add_argument("--python-prefix", help="where Python lives on the cluster's hosts, if not where it lives here "
                                           "(e.g. /usr/local)")
    p.add_argument("--force", action="store_true", help="replace an existing archive")
    p.set_defaults(func=cmd_pack)
    p = sub.add_parser("check-config", help="validate a config file and exit")
    p.add_argument("-c", "--config", required=True)
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.log_format, args.log_level.upper())
    try:
        return args.func(args)
    except (ConfigError, MissingExtra) as e:
        print(f"walbridge: {e}", file=sys.stderr)
        return 2


def spark_submit_main(argv: list[str] | None = None) -> int:
    """The consumer under ``spark-submit`` (:mod:`walbridge.spark_submit`):
    the master and the rest of Spark's settings come from spark-submit."""
    parser = argparse.ArgumentParser(prog="walbridge consumer (spark-submit)")
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--master", default=None, help="Spark master (spark-submit sets it; default local[*])")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging(args.log_format, args.log_level.upper())
    try:
        consumer_service(load_config(args.config), args.master, stop_on_signals())
    except (ConfigError, MissingExtra) as e:
        print(f"walbridge: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
