"""``walbridge`` command line: the operator's entry point to every part.

Invariants:
- The config is loaded and validated before any command touches a database or a
  broker; a bad config exits with status 2 and a message naming each bad key.
- Every command runs inside :func:`walbridge.runtime.run_command`: an expected
  failure is one or two lines and a documented exit code (0 ok, 1 differences
  found, 2 usage or config, 3 source, 4 Kafka or registry, 5 target, 70 a bug,
  130/143 stopped by SIGINT/SIGTERM), never a traceback unless ``--log-level
  debug``.
- A missing optional extra (the Spark consumer without pyspark) is one line
  saying how to install it, exit status 2, before anything starts.
- The global flags (``--log-format``, ``--log-level``) are accepted before or
  after the subcommand; :func:`parser` is the one place that registers both.
- Secrets are never printed (DSNs go through ``redact_dsn``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

from rich.console import Console

from producer.backfill_requests import request_backfill
from schemas.config import load_config
from schemas.failures import CONFIG, SOURCE, Failure, attributed
from walbridge.check import live_checks, render_checks
from walbridge.pack import pack
from walbridge.reconcile import reconcile, wait_for
from walbridge.render import render_status, render_verify, verify_details
from walbridge.runtime import (
    EXIT_DIFFERENCES,
    EXIT_OK,
    EXIT_SIGNAL,
    LOG_LEVELS,
    consumer_service,
    producer_service,
    run_command,
    setup_logging,
    stop_on_signals,
    version,
)
from walbridge.status import collect_status
from walbridge.up import TARGETS, run_up
from walbridge.verify import as_json, verify


def _endpoints(config):
    """The command's endpoints, for failures raised without an address."""
    return attributed(database=(SOURCE, config.source.dsn), kafka=config.kafka.bootstrap_servers,
                      registry=config.kafka.schema_registry_url)


def _known_shapes(config, names) -> None:
    unknown = [n for n in names if n not in {s.shape_name for s in config.shapes}]
    if unknown:
        raise Failure(CONFIG, f"no shape named {', '.join(unknown)} in the config "
                              f"(shapes: {', '.join(s.shape_name for s in config.shapes)})")


def cmd_producer(args) -> int:
    config = load_config(args.config)
    stop = stop_on_signals()
    producer_service(config, stop)
    return stop.exit_code()


def cmd_up(args) -> int:
    config = load_config(args.config) if args.config else None
    if config is not None and args.target != "postgresql":
        raise Failure(CONFIG, "--target chooses the embedded demo's target; with -c, the config's [consumer] "
                              "target does")
    rate = args.rate if args.rate is not None else (0.0 if config else 20.0)
    last = run_up(config, Path(args.data_dir), args.duration, rate, headless=args.headless, target=args.target)
    return EXIT_SIGNAL + last["signal"] if "signal" in last else EXIT_OK


def cmd_verify(args) -> int:
    config = load_config(args.config)
    with _endpoints(config):
        diffs = verify(config, args.shape or None)
    if args.json:
        print(json.dumps(as_json(diffs), indent=2, default=str))
    else:
        console = Console()
        console.print(render_verify(diffs))
        for line in verify_details(diffs):
            console.print(line)
    return EXIT_OK if all(d.ok for d in diffs) else EXIT_DIFFERENCES


def cmd_status(args) -> int:
    config = load_config(args.config)
    with _endpoints(config):
        status = collect_status(config)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        Console().print(render_status(status))
    return EXIT_OK


def cmd_consumer(args) -> int:
    config = load_config(args.config)
    stop = stop_on_signals()
    consumer_service(config, args.master, stop)
    return stop.exit_code()


def cmd_backfill(args) -> int:
    config = load_config(args.config)
    _known_shapes(config, [args.shape])
    with _endpoints(config):
        rid = request_backfill(config, args.shape)
        print(f"backfill of shape {args.shape} requested: {rid}")
        if args.wait:
            try:
                wait_for(config, [rid], args.timeout)
            except (TimeoutError, RuntimeError) as e:
                print(f"walbridge: {e}", file=sys.stderr)
                return EXIT_DIFFERENCES
    return EXIT_OK


def cmd_reconcile(args) -> int:
    config = load_config(args.config)
    _known_shapes(config, args.shape or ())
    console = Console()
    with _endpoints(config):
        try:
            before, after = reconcile(config, args.shape or None, wait=not args.no_wait, timeout=args.timeout,
                                      on_progress=console.print)
        except (TimeoutError, RuntimeError) as e:
            print(f"walbridge: {e}", file=sys.stderr)
            return EXIT_DIFFERENCES
    final = after if after is not None else before
    console.print(render_verify(final))
    return EXIT_OK if all(d.ok for d in final) or (after is None and args.no_wait) else EXIT_DIFFERENCES


def cmd_pack(args) -> int:
    try:
        out = pack(Path(args.output), args.python_prefix, args.force)
    except FileExistsError as e:
        raise Failure(CONFIG, str(e)) from None
    except subprocess.CalledProcessError as e:
        print(f"walbridge pack: installing into the new environment failed (exit status {e.returncode}); "
              "pip's output is above", file=sys.stderr)
        return EXIT_DIFFERENCES  # the command did not complete
    print(out)
    return EXIT_OK


def cmd_check(args) -> int:
    config = load_config(args.config)
    print(f"config ok: {len(config.shapes)} shape(s): " + ", ".join(s.shape_name for s in config.shapes))
    if not args.live:
        if any(s.where for s in config.shapes):
            # a filter's columns' types and collations are the source's to tell
            print("shape filters: syntax and constructs checked; their types, collations and literals are "
                  "checked against the source by check-config --live and when the producer starts")
        return EXIT_OK
    checks = live_checks(config)
    print(render_checks(checks))
    return checks.exit_code()


def add_global_flags(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """``--log-format`` and ``--log-level``; with ``defaults`` False (a
    subcommand) a flag not given leaves the value given before the subcommand."""
    keep = argparse.SUPPRESS
    parser.add_argument("--log-format", choices=["text", "json"], default="text" if defaults else keep,
                        help="text lines, or one JSON object per line")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO" if defaults else keep,
                        help="debug also shows the traceback of a failure")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="walbridge", description="PostgreSQL → Kafka (Avro, by shape) → Spark CDC")
    parser.add_argument("--version", action="version", version=f"walbridge {version()}")
    add_global_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func: Callable, help: str, config: bool | None = True) -> argparse.ArgumentParser:
        """Register a subcommand; ``config`` True: ``-c`` required, None: optional."""
        p = sub.add_parser(name, help=help)
        add_global_flags(p, defaults=False)
        if config is not False:
            p.add_argument("-c", "--config", required=bool(config),
                           help=None if config else "your own config; omit for the embedded demo")
        p.set_defaults(func=func)
        return p

    p = command("producer", cmd_producer, "stream PostgreSQL changes into the shape topics")
    p = command("consumer", cmd_consumer, "the Spark consumer (local[*]): apply the shape topics to the target")
    p.add_argument("--master", default="local[*]", help="Spark master URL")
    p = command("up", cmd_up, "run the whole pipeline with a live view (embedded default without -c)", config=None)
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--rate", type=float, help="demo workload transactions/s (default 20 embedded, 0 with -c)")
    p.add_argument("--data-dir", default=".walbridge/up", help="where embedded data and logs live")
    p.add_argument("--headless", action="store_true", help="no live view; print the final view")
    p.add_argument("--target", choices=list(TARGETS), default="postgresql",
                   help="the embedded demo's target: a PostgreSQL database, or Delta or Iceberg tables in "
                        "<data-dir>/lake")
    p = command("verify", cmd_verify, "compare every shape's target table with the source (exit 1 on differences)")
    p.add_argument("--shape", action="append", help="only this shape (repeatable)")
    p.add_argument("--json", action="store_true")
    p = command("status", cmd_status, "slot, writers, consumer groups and producer state")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command("backfill", cmd_backfill, "re-read a shape from a fresh snapshot while streaming goes on")
    p.add_argument("--shape", required=True, help="the shape's name")
    p.add_argument("--wait", action="store_true", help="follow it until the consumer has applied it")
    p.add_argument("--timeout", type=float, default=1800.0)
    p = command("reconcile", cmd_reconcile, "verify, backfill the key buckets that differ, verify again")
    p.add_argument("--shape", action="append", help="only this shape (repeatable)")
    p.add_argument("--no-wait", action="store_true", help="request the backfills and exit")
    p.add_argument("--timeout", type=float, default=1800.0)
    p = command("pack", cmd_pack, "build the Spark consumer's Python environment as one archive, "
                                  "for spark-submit --archives ENV.tar.gz#env on a cluster", config=False)
    p.add_argument("-o", "--output", default="walbridge-env.tar.gz", help="archive to write (.tar.gz, .zip, ...)")
    p.add_argument("--python-prefix", help="where Python lives on the cluster's hosts, if not where it lives here "
                                           "(e.g. /usr/local)")
    p.add_argument("--force", action="store_true", help="replace an existing archive")
    p = command("check-config", cmd_check, "validate a config file (--live: and everything it names) and exit")
    p.add_argument("--live", action="store_true",
                   help="connect to the source, broker, registry and target and print a checklist")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    return run_command(lambda: args.func(args), debug=args.log_level == "DEBUG")


def spark_submit_main(argv: list[str] | None = None) -> int:
    """The consumer under ``spark-submit`` (:mod:`walbridge.spark_submit`):
    the master and the rest of Spark's settings come from spark-submit."""
    parser = argparse.ArgumentParser(prog="walbridge consumer (spark-submit)")
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--master", default=None, help="Spark master (spark-submit sets it; default local[*])")
    add_global_flags(parser, defaults=True)
    args = parser.parse_args(argv)
    setup_logging(args.log_format, args.log_level)

    def consume() -> int:
        stop = stop_on_signals()
        consumer_service(load_config(args.config), args.master, stop)
        return stop.exit_code()

    return run_command(consume, debug=args.log_level == "DEBUG")


if __name__ == "__main__":
    sys.exit(main())
