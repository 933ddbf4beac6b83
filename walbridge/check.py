"""``walbridge check-config --live``: connect to everything the config names
and say, item by item, whether it will work.

Invariants:
- Read-only: nothing is created or changed (no slot, publication, topic,
  schema or table); what is missing and would be created is a note.
- One failing item never hides the others: each endpoint is checked as far
  as it answers, and an endpoint that does not answer is one failing item.
- The exit code is the first failure's endpoint's (2 config: a shape filter
  the source's catalog shows cannot be evaluated exactly; 3 source, 4 Kafka
  or registry, 5 target), 0 when nothing failed; a warning (something that
  works today but would lose data or the slot in a failover) fails nothing.
- Failover (PostgreSQL 17+): the primary's side (the slot's failover flag,
  its standbys' physical slots, ``synchronized_standby_slots``) and, for each
  other host of a multi-host ``[source] dsn`` that is a standby, whether it
  is set up to carry the slot and whether its copy is persistent yet (a
  temporary copy is dropped at promotion).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import psycopg
from confluent_kafka import TopicCollection
from confluent_kafka.admin import AclOperation, AdminClient
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from producer import catalog
from producer.replication import connect
from producer.slot_setup import FAILOVER_SLOTS_SINCE
from schemas import wire
from schemas.config import Config, redact_dsn
from schemas.failures import CONFIG, KAFKA, REGISTRY, SOURCE, TARGET, Failure, attributed
from schemas.kafka import METADATA_TIMEOUT, client_config, group_offsets
from schemas.registry import registry_client
from walbridge.runtime import EXIT_CODES, EXIT_OK

OK, FAILED, NOTE, WARN = "ok", "failed", "note", "warning"
_MARK = {OK: "✓", FAILED: "✗", NOTE: "·", WARN: "!"}


@dataclass(frozen=True)
class Check:
    endpoint: str
    item: str
    state: str  # OK, FAILED, NOTE (fine; something will be created) or WARN (works, but not through a failover)
    detail: str


class Checklist(list):
    def add(self, endpoint: str, item: str, state: str | bool, detail: str) -> None:
        if isinstance(state, bool):
            state = OK if state else FAILED
        self.append(Check(endpoint, item, state, detail))

    def failed(self, endpoint: str, item: str, failure: Failure) -> None:
        self.add(endpoint, item, FAILED, failure.problem + (f" (fix: {failure.fix})" if failure.fix else ""))

    def exit_code(self) -> int:
        return next((EXIT_CODES[c.endpoint] for c in self if c.state == FAILED), EXIT_OK)


def live_checks(config: Config) -> Checklist:
    checks = Checklist()
    _source(config, checks)
    _kafka(config, checks)
    if config.kafka.schema_registry_url:
        _registry(config, checks)
    if config.consumer.target_kind == "postgresql":
        _target(config, checks)
    elif config.consumer.target_kind == "delta":
        _lake(config.consumer.target_path, checks)
    elif config.consumer.target_kind == "iceberg":
        iceberg = config.consumer.iceberg
        _lake(iceberg.warehouse, checks, "Iceberg tables")
        if iceberg.catalog == "jdbc":  # Iceberg makes its catalog tables there: a connection is enough
            _database(TARGET, iceberg.catalog_dsn, checks, lambda conn: checks.add(
                TARGET, f"Iceberg catalog database {redact_dsn(iceberg.catalog_dsn)}", True, "reachable"))
    return checks


def render_checks(checks: Checklist) -> str:
    lines, endpoint = [], None
    for c in checks:
        if c.endpoint != endpoint:
            endpoint = c.endpoint
            lines.append(f"{endpoint}:")
        lines.append(f"  {_MARK[c.state]} {c.item}: {c.detail}")
    failed = sum(c.state == FAILED for c in checks)
    lines.append(f"{failed} check(s) failed" if failed else "all checks passed")
    return "\n".join(lines)


def _database(endpoint: str, dsn: str, checks: Checklist, inspect: Callable[[psycopg.Connection], None]) -> None:
    """Connect to the database at ``endpoint`` and ``inspect`` it; a failure
    is one failed check (the connection's, or what was being looked at)."""
    try:
        with attributed(database=(endpoint, dsn)):
            conn = connect(dsn, connect_timeout=10)
    except Failure as f:
        checks.failed(endpoint, f"connect to {redact_dsn(dsn)}", f)
        return
    with conn:
        try:
            with attributed(database=(endpoint, dsn)):
                inspect(conn)
        except Failure as f:
            checks.failed(endpoint, "catalog", f)


def _source(config: Config, checks: Checklist) -> None:
    _database(SOURCE, config.source.dsn, checks, lambda conn: _source_catalog(config, conn, checks))


def _source_catalog(config: Config, conn, checks: Checklist) -> None:
    user, db, server = conn.execute("SELECT current_user, current_database(), current_setting('server_version')"
                                    ).fetchone()
    checks.add(SOURCE, f"connect to {redact_dsn(config.source.dsn)}", True,
               f"as {user} to {db} (PostgreSQL {server})")
    tables, findings = catalog.inspect_source(conn, config)
    for f in findings:
        # a refused filter is the config's problem (exit status 2), found with the source's help
        checks.add(CONFIG if f.config else SOURCE, f.item, f.ok, f.detail)
    try:
        plan = catalog.plan_publication(list(tables.values()), config.source.keyless_tables)
    except catalog.SourceError as e:
        checks.add(SOURCE, "keyless tables", False, e.problem)
        plan = None
    pub = config.source.publication
    exists = conn.execute("SELECT count(*) FROM pg_publication WHERE pubname = %s", (pub,)).fetchone()[0]
    if exists:
        checks.add(SOURCE, f"publication {pub}", True, "exists (its tables are aligned to the shapes on start)")
    else:
        can_create = conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone()[0]
        tables_n = len(plan.full_tables) if plan else len(tables)
        checks.add(SOURCE, f"publication {pub}", NOTE if can_create else FAILED,
                   f"will be created for {tables_n} table(s)" if can_create else
                   f"does not exist and {user} may not create it (GRANT CREATE ON DATABASE {db} TO {user})")
    slot = catalog.slot_state(conn, config.source.slot)
    if slot is None:
        used, limit = conn.execute("SELECT (SELECT count(*) FROM pg_replication_slots), "
                                   "current_setting('max_replication_slots')::int").fetchone()
        checks.add(SOURCE, f"slot {config.source.slot}", NOTE if used < limit else FAILED,
                   "will be created (and the tables snapshotted)" if used < limit else
                   f"does not exist and all {limit} replication slots are taken (raise max_replication_slots)")
    elif slot["plugin"] != "pgoutput" or slot["slot_type"] != "logical":
        checks.add(SOURCE, f"slot {config.source.slot}", False, f"exists but is a {slot['slot_type']} slot of "
                   f"plugin {slot['plugin']!r}, not a logical pgoutput slot (choose another [source] slot)")
    else:
        active = f"in use by pid {slot['active_pid']} (a producer is running)" if slot["active"] else "not in use"
        checks.add(SOURCE, f"slot {config.source.slot}", True,
                   f"exists at {slot['confirmed_flush_lsn']}, {active}, retaining "
                   f"{(slot['retained_wal_bytes'] or 0) / 2**20:.1f} MiB of WAL")
    try:
        with attributed(database=(SOURCE, config.source.dsn)):
            with connect(config.source.dsn, replication="database", connect_timeout=10) as repl:
                repl.execute("IDENTIFY_SYSTEM")
        checks.add(SOURCE, "replication connection", True, "accepted (pg_hba.conf allows it)")
    except Failure as f:
        checks.failed(SOURCE, "replication connection", f)
    _failover(config, conn, slot, checks)


def _failover(config: Config, conn: psycopg.Connection, slot: dict | None, checks: Checklist) -> None:
    """Will the slot survive a failover of the source (see the module docstring)?"""
    name, version = config.source.slot, conn.info.server_version
    if version < FAILOVER_SLOTS_SINCE:
        checks.add(SOURCE, "failover", NOTE, f"PostgreSQL {version // 10000} keeps logical slots on the primary "
                   "only: after a failover the producer stops (exit 3) rather than re-snapshot; PostgreSQL 17 or "
                   "later carries the slot to a standby")
        return
    if not config.source.slot_failover:
        checks.add(SOURCE, "failover", NOTE, "[source] slot_failover = false: no standby keeps a copy of the "
                   "slot; after a failover the producer stops (exit 3) rather than re-snapshot")
        return
    if slot is None:
        checks.add(SOURCE, f"slot {name} failover", NOTE, "will be created as a failover slot")
    else:
        checks.add(SOURCE, f"slot {name} failover", OK if slot["failover"] else NOTE,
                   "enabled: standbys with sync_replication_slots keep a copy" if slot["failover"] else
                   "off: the producer enables it at its next start")
    standby_slots, synchronized = catalog.standby_slots(conn)
    if not standby_slots:
        checks.add(SOURCE, "standbys", NOTE, "no standby streams through a physical slot, so none can keep a "
                   f"copy of slot {name}; a standby carries it with {_STANDBY_SETTINGS}")
    elif not synchronized:
        checks.add(SOURCE, "synchronized_standby_slots", WARN,
                   f"empty, while standbys stream through the physical slots {', '.join(standby_slots)}: the "
                   "producer may read changes a standby has not received; after a failover to it they are in "
                   "Kafka but not at the source, and the producer stops (exit 3) until a full re-snapshot "
                   "(fix: ALTER SYSTEM SET synchronized_standby_slots = "
                   f"'{','.join(standby_slots)}'; SELECT pg_reload_conf();)")
    else:
        checks.add(SOURCE, "synchronized_standby_slots", OK, f"{', '.join(synchronized)}: the producer reads "
                   "only what those standbys have received")
    _standbys(config, checks)


_STANDBY_SETTINGS = ("primary_slot_name = '<its physical slot>', hot_standby_feedback = on, "
                     "sync_replication_slots = on and a dbname in primary_conninfo")


def _standbys(config: Config, checks: Checklist) -> None:
    """Each other host of a multi-host ``[source] dsn`` that is a standby: set
    up to carry the slot, and its copy."""
    params = conninfo_to_dict(config.source.dsn)
    hosts = (params.get("host") or "").split(",")
    if len(hosts) < 2:
        checks.add(SOURCE, "standby hosts", NOTE, "[source] dsn names one host: list the standby too "
                   "(host=primary,standby with target_session_attrs=read-write) for the producer to follow a "
                   "failover and for this check to look at the standby")
        return
    if params.get("target_session_attrs") not in ("read-write", "primary"):
        checks.add(SOURCE, "target_session_attrs", WARN, "[source] dsn names several hosts without "
                   "target_session_attrs=read-write: libpq may connect to a standby, which the producer then "
                   "waits on until it is promoted")
    ports = (params.get("port") or "").split(",")
    addrs = params["hostaddr"].split(",") if params.get("hostaddr") else None
    for i, host in enumerate(hosts):
        port = ports[i] if len(ports) == len(hosts) else ports[0]
        one = {**params, "host": host, "port": port, "target_session_attrs": "any"}
        if addrs:
            one["hostaddr"] = addrs[i]
        dsn = make_conninfo("", **{k: v for k, v in one.items() if v})
        where = f"host {host}:{port}" if port else f"host {host}"
        try:
            with attributed(database=(SOURCE, dsn)):
                with connect(dsn, connect_timeout=5) as conn:
                    if conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
                        _standby(config.source.slot, conn, where, checks)
        except Failure as f:
            checks.add(SOURCE, where, NOTE, f"does not answer ({f.problem})")


def _standby(slot: str, conn: psycopg.Connection, where: str, checks: Checklist) -> None:
    settings = dict(conn.execute(
        "SELECT name, setting FROM pg_settings WHERE name IN ('sync_replication_slots', 'hot_standby_feedback', "
        "'primary_slot_name', 'primary_conninfo')").fetchall())
    copy = conn.execute("SELECT synced, temporary, confirmed_flush_lsn::text FROM pg_replication_slots "
                        "WHERE slot_name = %s", (slot,)).fetchone()
    checks.add(SOURCE, f"standby {where}", *standby_readiness(slot, settings, copy))


def standby_readiness(slot: str, settings: dict[str, str], copy: tuple[bool, bool, str | None] | None
                      ) -> tuple[str, str]:
    """(state, detail) of a standby for ``slot``, from its ``pg_settings``
    (``primary_conninfo`` absent where this role may not read it) and its
    copy of the slot (synced, temporary, confirmed LSN; None: none)."""
    missing = [f"{k} = on" for k in ("sync_replication_slots", "hot_standby_feedback") if settings.get(k) != "on"]
    if not settings.get("primary_slot_name"):
        missing.append("primary_slot_name = '<its physical slot on the primary>'")
    conninfo = settings.get("primary_conninfo")
    if conninfo is not None and "dbname" not in conninfo_to_dict(conninfo):
        missing.append("a dbname in primary_conninfo")
    if missing:
        return WARN, (f"not set up to keep a copy of slot {slot}: set {', '.join(missing)} (ALTER SYSTEM SET ...; "
                      "SELECT pg_reload_conf();)")
    if copy is None:
        return WARN, (f"set up for slot synchronization, but holds no copy of slot {slot} yet (a failover slot "
                      "appears within seconds of its creation)")
    synced, temporary, lsn = copy
    if not synced:
        return WARN, (f"holds a slot {slot} that is not synchronized from the primary: a promotion would not carry "
                      "walbridge's slot on")
    if temporary:
        return WARN, (f"holds a temporary copy of slot {slot}, which a promotion drops: it becomes persistent once "
                      "the primary's slot advances past the position this standby reserved (the producer streaming "
                      "changes the consumers confirm)")
    return OK, f"holds a persistent synchronized copy of slot {slot} (at {lsn}): a promotion carries it on"


def _kafka(config: Config, checks: Checklist) -> None:
    bootstrap = config.kafka.bootstrap_servers
    conf = client_config(bootstrap, config.kafka.client)
    admin = AdminClient(conf)
    try:
        with attributed(kafka=bootstrap):
            meta = admin.list_topics(timeout=METADATA_TIMEOUT)
    except Failure as f:
        checks.failed(KAFKA, f"broker {bootstrap}", f)
        return
    checks.add(KAFKA, f"broker {bootstrap}", True, f"{len(meta.brokers)} broker(s), cluster {meta.cluster_id}")
    prefix = config.kafka.topic_prefix
    topics = [config.topic(s) for s in config.shapes] + [
        t for t in wire.internal_topics(prefix) if t != wire.schemas_topic(prefix) or not config.kafka.schema_registry_url]
    existing = [t for t in topics if t in meta.topics]
    missing = [t for t in topics if t not in meta.topics]
    try:
        with attributed(kafka=bootstrap):
            for topic, future in admin.describe_topics(TopicCollection(existing)).items() if existing else ():
                described = future.result()
                checks.add(KAFKA, f"topic {topic}", True, f"exists, {len(described.partitions)} partition(s), "
                           "described")
            if missing:
                ops = admin.describe_cluster(include_authorized_operations=True).result().authorized_operations
                if ops is None:
                    checks.add(KAFKA, "create topics", NOTE, f"{len(missing)} topic(s) will be created "
                               "(the broker reports no ACLs: creation is assumed allowed)")
                else:
                    allowed = bool({AclOperation.CREATE, AclOperation.ALL} & set(ops))
                    checks.add(KAFKA, "create topics", NOTE if allowed else FAILED,
                               f"{len(missing)} topic(s) will be created" if allowed else
                               f"{len(missing)} topic(s) are missing and this principal may not create topics "
                               "(grant it Create on the cluster, or create them: "
                               + ", ".join(missing) + ")")
            groups = config.ack_groups
            if groups and existing:
                group_offsets(conf, groups, [(existing[0], 0)])
                checks.add(KAFKA, "consumer groups", True, f"committed offsets of {', '.join(groups)} readable")
    except Failure as f:
        checks.failed(KAFKA, "topics and groups", f)


def _registry(config: Config, checks: Checklist) -> None:
    url = config.kafka.schema_registry_url
    try:
        with attributed(registry=url):
            subjects = registry_client(config.kafka.registry_client_config()).get_subjects()
        checks.add(REGISTRY, url, True, f"answers ({len(subjects)} subject(s))")
    except Failure as f:
        checks.failed(REGISTRY, url, f)


def _target(config: Config, checks: Checklist) -> None:
    _database(TARGET, config.consumer.target_dsn, checks, lambda conn: _target_catalog(config, conn, checks))


def _lake(target_path: str, checks: Checklist, what: str = "Delta tables") -> None:
    """A local target_path (or Iceberg warehouse) must be a folder walbridge
    may write (or create); a URI is Spark's Hadoop file systems' to reach,
    checked when the consumer starts."""
    parsed = urlparse(target_path)
    if parsed.scheme not in ("", "file"):
        checks.add(TARGET, f"{what} under {target_path}", True, "a URI: reached through Spark's file systems "
                   "when the consumer starts")
        return
    path = Path(parsed.path if parsed.scheme else target_path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    ok = existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)
    checks.add(TARGET, f"{what} under {path}", ok,
               ("exists, writable" if existing == path else f"will be created in {existing}") if ok
               else f"{existing} is not a folder this user may write")


def _target_catalog(config: Config, conn: psycopg.Connection, checks: Checklist) -> None:
    user, db, read_only = conn.execute(
        "SELECT current_user, current_database(), pg_is_in_recovery() "
        "OR current_setting('transaction_read_only')::bool").fetchone()
    checks.add(TARGET, f"connect to {redact_dsn(config.consumer.target_dsn)}", not read_only,
               f"as {user} to {db}" + (" — read-only (a standby?): point [consumer] target_dsn at "
                                       "a primary" if read_only else ""))
    schemas = sorted({wire.target_table(s.shape_name)[0] for s in config.shapes} | {wire.META_SCHEMA})
    for schema in schemas:
        exists, may = conn.execute(
            "SELECT n.oid IS NOT NULL, CASE WHEN n.oid IS NULL THEN "
            "has_database_privilege(current_database(), 'CREATE') "
            "ELSE has_schema_privilege(n.oid, 'CREATE') END "
            "FROM (SELECT 1) one LEFT JOIN pg_namespace n ON n.nspname = %s", (schema,)).fetchone()
        checks.add(TARGET, f"schema {schema}", may,
                   ("exists, " if exists else "will be created, ")
                   + ("writable" if may else f"but {user} may not create in it "
                      f"(GRANT CREATE ON {'SCHEMA ' + schema if exists else 'DATABASE ' + db} TO {user})"))
