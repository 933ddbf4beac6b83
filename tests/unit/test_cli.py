"""The command line: --version, global flags on either side of the subcommand,
and the error boundary's exit codes and reports."""

from __future__ import annotations

import json
import logging
import signal

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException

from schemas.config import ConfigError
from schemas.failures import KAFKA, SOURCE, TARGET, Failure
from schemas.kafka import RateLimit
from walbridge import runtime
from walbridge.cli import main, parser


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("walbridge ")


@pytest.mark.parametrize("argv", [
    ["--log-format", "json", "--log-level", "debug", "producer", "-c", "f.toml"],
    ["producer", "-c", "f.toml", "--log-format", "json", "--log-level", "debug"],
    ["--log-format", "text", "producer", "--log-format", "json", "-c", "f.toml", "--log-level", "DEBUG"],
])
def test_global_flags_go_before_or_after_the_subcommand(argv):
    args = parser().parse_args(argv)
    assert (args.log_format, args.log_level, args.config) == ("json", "DEBUG", "f.toml")


def test_defaults_hold_when_no_flag_is_given():
    args = parser().parse_args(["status", "-c", "f.toml"])
    assert (args.log_format, args.log_level) == ("text", "INFO")


def test_an_unknown_log_level_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["status", "-c", "f.toml", "--log-level", "verbose"])
    assert e.value.code == 2 and "invalid choice: 'VERBOSE'" in capsys.readouterr().err


def _raise(error: BaseException):
    def command() -> int:
        raise error
    return command


@pytest.mark.parametrize("error,code", [
    (ConfigError(["source.dsn: is required"]), 2),
    (Failure(SOURCE, "wal_level is 'replica'"), 3),
    (psycopg.OperationalError("connection failed: FATAL:  password authentication failed for user \"a\""), 3),
    (Failure(KAFKA, "cannot reach the broker", permanent=False), 4),
    (KafkaException(KafkaError(KafkaError._INVALID_ARG, "No such configuration property")), 4),
    (Failure(TARGET, 'database "w" does not exist'), 5),
    (ZeroDivisionError("a bug"), 70),
    (KeyboardInterrupt(), 130),
], ids=["config", "source", "source-psycopg", "kafka", "kafka-librdkafka", "target", "bug", "ctrl-c"])
def test_exit_codes(error, code):
    assert runtime.run_command(_raise(error)) == code


def test_a_failure_is_one_or_two_lines_and_a_traceback_only_in_debug(capsys):
    failure = Failure(SOURCE, 'database "x" does not exist', "create it", address="postgresql://a:pw@h/x")
    runtime.run_command(_raise(failure))
    err = capsys.readouterr().err
    assert err.splitlines() == ["walbridge: source postgresql://a:***@h/x: database \"x\" does not exist",
                                "  fix: create it"]
    runtime.run_command(_raise(failure), debug=True)
    assert "Traceback" in capsys.readouterr().err


def test_in_json_the_failure_is_one_json_record(capsys):
    runtime.setup_logging("json", "INFO")
    try:
        runtime.run_command(_raise(Failure(KAFKA, "cannot reach the broker", "is it up?", address="k:1")))
        lines = capsys.readouterr().err.splitlines()
        record = json.loads(lines[-1])
        assert record["level"] == "error" and record["msg"] == "kafka k:1: cannot reach the broker\n  fix: is it up?"
    finally:
        runtime.setup_logging("text", "INFO")


def test_a_signal_gives_its_exit_code():
    stop = runtime.Stop()
    assert stop.exit_code() == 0
    stop.signum = signal.SIGTERM
    assert stop.exit_code() == 143


def test_librdkafka_records_of_a_kind_pass_once_per_window():
    now = [0.0]
    limit = RateLimit(window=30.0, clock=lambda: now[0])

    def record(text: str) -> logging.LogRecord:
        return logging.LogRecord("walbridge.librdkafka", logging.ERROR, __file__, 1, "%s [%s] %s",
                                 ("FAIL", "rdkafka#producer-1", text), None)

    refused = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after {}ms)"
    passed = []
    for i in range(100):
        now[0] = i * 0.5  # 50 s of a broker refusing, two attempts a second
        r = record(refused.format(i % 7))
        if limit.filter(r):
            passed.append(r.getMessage())
    assert len(passed) == 2  # at 0 s and at 30 s
    assert passed[1].endswith("(59 more like it in the last 30s)")
    assert limit.filter(record("another kind of message"))
