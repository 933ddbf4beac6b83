"""Bad inputs as a new user makes them, each through the real ``walbridge``
command against real PostgreSQL and the real broker: the exact message (one
or two lines naming the endpoint, what is wrong and the fix), the exit code,
how long it takes to fail, and never a secret or a traceback in the output.

Exit codes: 2 usage or config, 3 source, 4 Kafka or registry, 5 target
(``walbridge.runtime.EXIT_CODES``). Permanent failures fail at once, untried again;
a transient one (a refused connection) is retried until
``reconnect_max_elapsed``. The cases run three at a time (they are
independent processes, and most of their time is Python starting).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from tests.conftest import _pg_scratch_dir
from tests.helpers import wait_for
from walbridge.embedded import PostgresCluster, free_port

ROOT = Path(__file__).resolve().parents[2]
SECRET = "Wb-S3cret-pw"  # in every DSN and secret setting: it must never be printed
WRONG = SECRET + "-wrong"  # a wrong password is a secret too
SFX = uuid.uuid4().hex[:6]
# A permanent failure is never retried (no "retrying in" line, asserted); the
# bound only tells an exit from a process that hangs or retries for good, with
# room for a loaded 2-core machine, where Python alone took 10 s to start.
PERMANENT = 30.0


@dataclass(frozen=True)
class Bad:
    id: str
    argv: str  # after `walbridge`; {config} is the case's config file
    toml: str | None  # the config, a template over Servers' fields; None: no file
    fragment: str  # must appear in the output
    code: int
    within: float = PERMANENT
    at_least: float = 0.0
    env: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # name -> content, next to the config


def config(dsn: str = "{src}", source: str = "", kafka: str = "", shapes: str = 'table = "public.orders"',
           tail: str = "", broker: str = "{broker}") -> str:
    return (f'[source]\ndsn = "{dsn}"\nslot = "{{slot}}"\npublication = "{{slot}}"\n{source}\n'
            f'[kafka]\nbootstrap_servers = "{broker}"\ntopic_prefix = "{{prefix}}"\n{kafka}\n'
            f"[[shapes]]\n{shapes}\n{tail}\n")


TARGET = '[consumer]\ntarget_dsn = "{tgt}"\n'

CASES = [
    # -- config and usage: exit 2 --------------------------------------------
    Bad("missing config file", "check-config -c nowhere.toml", None, "cannot read config file", 2),
    Bad("not TOML", "check-config -c {config}", "[source\n", "not valid TOML", 2),
    Bad("misspelt key", "producer -c {config}", config(source='dns = "x"'), "source.dns: is not a known setting", 2),
    Bad("unset variable", "producer -c {config}",
        config(dsn="postgresql://postgres:${{WB_BAD_UNSET}}@127.0.0.1:{port}/{db}"),
        "source.dsn: environment variable WB_BAD_UNSET is not set", 2),
    Bad("missing secret file", "producer -c {config}", config(source='password_file = "missing-secret"'),
        "source.password_file: cannot read ", 2),
    Bad("password twice", "producer -c {config}",
        config(source=f'password = "{SECRET}"\npassword_file = "pw"'),
        "source.password_file: password is set too; keep one of them", 2, files={"pw": SECRET + "\n"}),
    Bad("unknown client property", "check-config -c {config}",
        config(kafka='[kafka.client]\n"no.such.property" = "1"'),
        'kafka.client: No such configuration property: "no.such.property"', 2),
    Bad("invalid client value", "producer -c {config}", config(kafka='[kafka.client]\n"acks" = "maybe"'),
        'kafka.client: Invalid value for configuration property "request.required.acks"', 2),
    Bad("SASL without credentials", "producer -c {config}",
        config(kafka='[kafka.client]\n"security.protocol" = "SASL_PLAINTEXT"\n"sasl.mechanism" = "PLAIN"'),
        "sasl.username and sasl.password must be set", 2),
    Bad("unknown DSN option", "producer -c {config}",
        config(dsn=f"host=127.0.0.1 port={{port}} password={SECRET} nosuch=1"),
        "source.dsn: is not a valid PostgreSQL connection string", 2),
    Bad("function in a filter", "producer -c {config}",
        config(shapes="table = \"public.orders\"\nwhere = \"lower(region) = 'eu'\""), "shapes[0].where: ", 2),
    Bad("unknown log level", "check-config -c {config} --log-level verbose", config(),
        "argument --log-level: invalid choice: 'VERBOSE'", 2),
    Bad("unknown command", "replicate -c {config}", config(), "invalid choice: 'replicate'", 2),
    Bad("verify without target_dsn", "verify -c {config}", config(),
        "consumer.target_dsn: is required to verify", 2),
    Bad("consumer without target_dsn", "consumer -c {config}", config(),
        "consumer.target_dsn: is required by the consumer", 2),
    Bad("backfill of an unknown shape", "backfill -c {config} --shape nosuch", config(),
        "no shape named nosuch in the config (shapes: public.orders)", 2),
    # -- the source: exit 3 --------------------------------------------------
    Bad("wrong password", "producer -c {config}", config(dsn=f"postgresql://wb_pw:{WRONG}@127.0.0.1:{{sport}}/app"),
        'source postgresql://wb_pw:***@127.0.0.1:{sport}/app: password authentication failed for user "wb_pw"\n'
        "  fix: check the user and password in [source] dsn", 3),
    Bad("wrong password (status)", "status -c {config}",
        config(dsn=f"postgresql://wb_pw:{WRONG}@127.0.0.1:{{sport}}/app"),
        'password authentication failed for user "wb_pw"', 3),
    Bad("wal_level replica", "producer -c {config}",
        config(dsn="postgresql://wb_pw@127.0.0.1:{sport}/app", source="password_file = \"pw\""),
        "wal_level is 'replica'; logical replication needs wal_level = logical", 3, files={"pw": SECRET + "\n"}),
    Bad("unknown database", "producer -c {config}",
        config(dsn=f"postgresql://postgres:{SECRET}@127.0.0.1:{{port}}/wbbad_nodb"),
        'database "wbbad_nodb" does not exist\n  fix: create the database, or correct its name in [source] dsn', 3),
    Bad("unknown role", "producer -c {config}",
        config(dsn=f"postgresql://wbbad_nobody:{SECRET}@127.0.0.1:{{port}}/{{db}}"),
        'role "wbbad_nobody" does not exist', 3),
    Bad("port out of range", "producer -c {config}",
        config(dsn=f"postgresql://postgres:{SECRET}@127.0.0.1:99999/{{db}}"), 'invalid port number: "99999"', 3),
    Bad("missing table", "producer -c {config}", config(shapes='table = "public.nosuch"'),
        "shapes[0] (public.nosuch).table: table public.nosuch does not exist", 3),
    Bad("unknown column", "producer -c {config}", config(shapes='table = "public.orders"\ncolumns = ["id", "nope"]'),
        "shapes[0] (public.orders).columns: nope not in public.orders (columns: id, region, total)", 3),
    Bad("columns without the key", "producer -c {config}",
        config(shapes='table = "public.orders"\ncolumns = ["region"]'),
        "must include the primary key column(s) id of public.orders", 3),
    Bad("filter on an unknown column", "producer -c {config}",
        # the filter is compiled against the source's catalog: a config error (2), as every refused filter
        config(shapes='table = "public.orders"\nwhere = "nope = 1"'), "unknown column 'nope'", 2),
    Bad("role without REPLICATION", "producer -c {config}",
        config(dsn=f"postgresql://wbbad_norepl_{SFX}:{SECRET}@127.0.0.1:{{port}}/{{db}}"),
        f"role wbbad_norepl_{SFX} lacks the REPLICATION attribute (ALTER ROLE wbbad_norepl_{SFX} WITH REPLICATION)",
        3),
    Bad("role without SELECT", "producer -c {config}",
        config(dsn=f"postgresql://wbbad_nosel_{SFX}:{SECRET}@127.0.0.1:{{port}}/{{db}}"),
        "cannot SELECT from public.orders (needed for the snapshot", 3),
    Bad("keyless table", "producer -c {config}", config(shapes='table = "public.log"'),
        "public.log have no primary key and REPLICA IDENTITY DEFAULT", 3),
    Bad("slot of another plugin", "producer -c {config}", config().replace('slot = "{slot}"', 'slot = "{td_slot}"'),
        "exists but is not a logical pgoutput slot", 3),
    Bad("source refuses connections", "producer -c {config}",
        config(dsn=f"postgresql://postgres:{SECRET}@127.0.0.1:{{closed}}/{{db}}",
               source="reconnect_max_backoff = 0.5\nreconnect_max_elapsed = 2"),
        "Connection refused", 3, within=PERMANENT + 2, at_least=2.0),
    Bad("live check: missing table", "check-config -c {config} --live",
        config(shapes='table = "public.nosuch"', tail=TARGET),
        "✗ shapes[0] (public.nosuch).table: table public.nosuch does not exist", 3),
    # -- Kafka and the registry: exit 4 ---------------------------------------
    Bad("live check: broker unreachable", "check-config -c {config} --live", config(broker="127.0.0.1:{closed}"),
        "✗ broker 127.0.0.1:{closed}: cannot reach the broker", 4, within=PERMANENT + 10),
    Bad("live check: registry unreachable", "check-config -c {config} --live",
        config(kafka='schema_registry_url = "http://127.0.0.1:{closed}"'),
        "✗ http://127.0.0.1:{closed}: cannot reach the schema registry", 4),
    # -- the target: exit 5 ---------------------------------------------------
    Bad("verify: unknown target database", "verify -c {config}",
        config(tail=f'[consumer]\ntarget_dsn = "postgresql://postgres:{SECRET}@127.0.0.1:{{port}}/wbbad_nowh"'),
        'target postgresql://postgres:***@127.0.0.1:{port}/wbbad_nowh: database "wbbad_nowh" does not exist', 5),
    Bad("consumer: unknown target database", "consumer -c {config}",
        config(tail=f'[consumer]\ntarget_dsn = "postgresql://postgres:{SECRET}@127.0.0.1:{{port}}/wbbad_nowh"'),
        'database "wbbad_nowh" does not exist\n  fix: create the database, or correct its name in '
        "[consumer] target_dsn", 5),
    Bad("live check: target refuses", "check-config -c {config} --live",
        config(tail=f'[consumer]\ntarget_dsn = "postgresql://wbbad_nobody:{SECRET}@127.0.0.1:{{port}}/{{db}}"'),
        '✗ connect to postgresql://wbbad_nobody:***@127.0.0.1:{port}/{db}: role "wbbad_nobody" does not exist', 5),
]


@dataclass
class Servers:
    """What the templates refer to."""

    src: str
    tgt: str
    port: int
    sport: int  # the strict cluster: password authentication, wal_level = replica
    db: str
    broker: str
    prefix: str
    slot: str
    td_slot: str
    closed: int  # a port nothing listens on

    def fill(self, text: str) -> str:
        return text.format(**vars(self))


@pytest.fixture(scope="module")
def strict_cluster(tmp_path_factory):
    """A cluster of its own that wants passwords from wb_pw and has wal_level = replica."""
    with _pg_scratch_dir(tmp_path_factory, "strict") as base:
        cluster = PostgresCluster(base).start()
        try:
            with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
                conn.execute(f"CREATE ROLE wb_pw LOGIN REPLICATION PASSWORD '{SECRET}'")
                conn.execute("CREATE DATABASE app")
                conn.execute("ALTER SYSTEM SET wal_level = replica")
            hba = cluster.data_dir / "pg_hba.conf"
            hba.write_text("host all wb_pw 127.0.0.1/32 scram-sha-256\n"
                           "host replication wb_pw 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
            cluster.stop()
            cluster.start()
            with psycopg.connect(cluster.dsn("app"), autocommit=True) as conn:
                conn.execute("CREATE TABLE orders (id int PRIMARY KEY, region text, total numeric)")
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def servers(pg_cluster, kafka_broker, strict_cluster):
    name = f"wbbad_{SFX}"
    pg_cluster.create_database(name)
    td_slot = f"wbbad_td_{SFX}"
    with psycopg.connect(pg_cluster.dsn(name), autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, region text, total numeric)")
        conn.execute("CREATE TABLE log (msg text)")
        conn.execute(f"CREATE ROLE wbbad_norepl_{SFX} LOGIN")
        conn.execute(f"CREATE ROLE wbbad_nosel_{SFX} LOGIN REPLICATION")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (td_slot,))
    src = pg_cluster.dsn(name).replace("postgres@", f"postgres:{SECRET}@")
    try:
        yield Servers(src=src, tgt=src, port=pg_cluster.port, sport=strict_cluster.port, db=name,
                      broker=kafka_broker.bootstrap, prefix=f"wbbad{SFX}", slot=f"wbbad_{SFX}", td_slot=td_slot,
                      closed=free_port())
    finally:
        pg_cluster.drop_database(name)
        with psycopg.connect(pg_cluster.dsn(), autocommit=True) as conn:
            conn.execute(f"DROP ROLE IF EXISTS wbbad_norepl_{SFX}, wbbad_nosel_{SFX}")


@dataclass
class Outcome:
    code: int
    out: str
    seconds: float


def walbridge(argv: list[str], cwd: Path, env: dict | None = None, timeout: float = 90) -> Outcome:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "walbridge", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    return Outcome(done.returncode, done.stdout + done.stderr, time.monotonic() - started)


def _run(case: Bad, servers: Servers, base: Path) -> Outcome:
    cwd = base / case.id.replace(" ", "_").replace(":", "")
    cwd.mkdir()
    for name, content in case.files.items():
        (cwd / name).write_text(content)
    if case.toml is not None:
        (cwd / "wb.toml").write_text(servers.fill(case.toml))
    argv = [servers.fill(a) if a != "{config}" else str(cwd / "wb.toml") for a in case.argv.split()]
    return walbridge(argv, cwd, case.env)


@pytest.fixture(scope="module")
def outcomes(servers, tmp_path_factory) -> dict[str, Outcome]:
    base = tmp_path_factory.mktemp("bad")
    with ThreadPoolExecutor(3) as pool:
        futures = {c.id: pool.submit(_run, c, servers, base) for c in CASES}
        got = {k: f.result() for k, f in futures.items()}
    for c in CASES:  # the table, for `pytest -s`
        print(f"{c.id:36} exit {got[c.id].code:3}  {got[c.id].seconds:5.1f}s  "
              f"{servers.fill(c.fragment).splitlines()[0][:90]}")
    return got


def test_the_table_is_long_enough():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_gets_a_clear_error_and_its_exit_code(case: Bad, servers, outcomes):
    got = outcomes[case.id]
    expected = servers.fill(case.fragment)
    assert expected in got.out, got.out
    assert got.code == case.code, got.out
    assert case.at_least <= got.seconds <= case.within, f"failed after {got.seconds:.1f}s"
    if not case.at_least:
        assert "retrying in" not in got.out, got.out
    assert SECRET not in got.out
    assert "Traceback" not in got.out
    failure_lines = [ln for ln in got.out.splitlines() if ln.startswith("walbridge: ") or ln.startswith("  fix: ")]
    assert failure_lines or "✗" in got.out or "usage:" in got.out, got.out


def test_a_live_check_of_a_good_config_passes(servers, tmp_path):
    (tmp_path / "wb.toml").write_text(servers.fill(config(tail=TARGET)))
    got = walbridge(["check-config", "-c", str(tmp_path / "wb.toml"), "--live"], tmp_path)
    assert got.code == 0 and got.out.rstrip().endswith("all checks passed"), got.out
    for line in ("✓ wal_level: wal_level is 'logical'", "✓ shapes[0] (public.orders).table: public.orders: key (id)",
                 "· slot wbbad_", "✓ replication connection", f"✓ broker {servers.broker}", "✓ schema public"):
        assert line in got.out, got.out
    assert SECRET not in got.out


def test_a_traceback_only_with_log_level_debug(servers, tmp_path):
    (tmp_path / "wb.toml").write_text(servers.fill(config(shapes='table = "public.nosuch"')))
    got = walbridge(["producer", "-c", str(tmp_path / "wb.toml"), "--log-level", "debug"], tmp_path)
    assert got.code == 3 and "Traceback" in got.out and "table public.nosuch does not exist" in got.out
    assert SECRET not in got.out


def test_the_json_log_stays_json_while_the_broker_is_down(source_db, private_kafka_broker, topic_prefix, tmp_path):
    """`--log-format json` after the subcommand (as the README writes it): every
    line on stderr is one JSON object, librdkafka's included, while the broker
    is gone; the producer waits (it never exits on its own) and names the broker."""
    with psycopg.connect(source_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, region text, total numeric)")
    slot = f"wb_{topic_prefix}"
    path = tmp_path / "wb.toml"
    path.write_text(f'[source]\ndsn = "{source_db}"\nslot = "{slot}"\npublication = "{slot}"\n'
                    f'[kafka]\nbootstrap_servers = "{private_kafka_broker.bootstrap}"\ntopic_prefix = "{topic_prefix}"\n'
                    '[kafka.client]\n"message.timeout.ms" = 3000\n'
                    '[[shapes]]\ntable = "public.orders"\n[ack]\nconsumer_groups = []\n')
    log = tmp_path / "producer.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "walbridge", "producer", "-c", str(path), "--log-format", "json"],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        with psycopg.connect(source_db, autocommit=True) as conn:
            wait_for(lambda: conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s",
                                          (slot,)).fetchone() == (True,), timeout=60, what="streaming")
            private_kafka_broker.stop()
            conn.execute("INSERT INTO orders SELECT g, 'eu', g FROM generate_series(1, 50) g")
            waiting = f"kafka {private_kafka_broker.bootstrap}: cannot reach the broker"
            wait_for(lambda: waiting in log.read_text(), timeout=60, what="the producer to say it waits for Kafka")
        assert proc.poll() is None, "the producer exited while the broker was down"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line is JSON
    assert {"ts", "level", "logger", "msg"} <= set(records[0])
    assert any(r["logger"] == "walbridge.librdkafka" for r in records)
    assert any(r["level"] == "warning" and "retrying in" in r["msg"] and private_kafka_broker.bootstrap in r["msg"]
               for r in records)
