"""Which Kafka topics hold a replication slot's data, and which PostgreSQL
server the slot was read on, recorded in the source database itself: the one
record that survives a broker that lost everything, and that a physical
standby carries through a failover.

Invariants:
- ``_walbridge.producer_slots`` holds, per slot, the topic prefix and the
  Kafka cluster id its data went to, and the server (system identifier and
  timeline, :class:`producer.failover.Server`) it was last read on. It is
  written when the slot is created (and adopted, with the running config, by
  a slot from before it existed), and read at every start: a slot bound
  elsewhere is never dropped nor its database re-snapshotted by a changed
  config (see :mod:`producer.recovery`), and a server change is judged by
  :mod:`producer.failover`. After a failover the record follows the slot's
  synchronized copy: same database and topics, the new server.
- It also holds a slot's resend mark: the highest commit LSN a run whose
  Kafka deliveries failed had produced (``mark_resend``), written before the
  next run starts and cleared once a run confirmed past it; a new slot of
  the name starts without one.
- A table from before the server columns gets them (``ADD COLUMN IF NOT
  EXISTS``) at the next write; read before that, its server is unknown.
- A role that may not create the table stops the producer with the grant (or
  the table's DDL) it needs; nothing here guesses.
"""

from __future__ import annotations

import logging

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from producer.failover import Server
from producer.recovery import Binding
from schemas import wire

TABLE = wire.SLOT_BINDING_TABLE
DDL = f"""CREATE SCHEMA IF NOT EXISTS {wire.META_SCHEMA};
CREATE TABLE IF NOT EXISTS {wire.META_SCHEMA}.{TABLE} (
    slot_name text PRIMARY KEY,
    topic_prefix text NOT NULL,
    kafka_cluster_id text,
    bound_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE {wire.META_SCHEMA}.{TABLE} ADD COLUMN IF NOT EXISTS system_identifier text,
    ADD COLUMN IF NOT EXISTS timeline bigint, ADD COLUMN IF NOT EXISTS resend_until bigint"""
_SERVER_COLUMNS = ("system_identifier", "timeline")
_ADDED_COLUMNS = (*_SERVER_COLUMNS, "resend_until")

log = logging.getLogger("walbridge.producer")


class BindingError(RuntimeError):
    """The slot's binding cannot be read or recorded."""


def _ident() -> sql.Composable:
    return sql.Identifier(wire.META_SCHEMA, TABLE)


def _columns(conn: psycopg.Connection) -> set[str]:
    """The table's columns (none: no table)."""
    rows = conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 "
                        "AND NOT attisdropped", (f"{wire.META_SCHEMA}.{TABLE}",)).fetchall()
    return {r[0] for r in rows}


def _ensure(conn: psycopg.Connection) -> set[str]:
    """The table, created if missing, with the server columns where this role
    may add them; returns its columns."""
    columns = _columns(conn)
    if set(_ADDED_COLUMNS) <= columns:
        return columns  # created before (perhaps by an administrator: CREATE SCHEMA would need a grant)
    create, alter = DDL.rsplit(";\n", 1)
    user, db = conn.info.user, conn.info.dbname
    if not columns:
        try:
            for statement in create.split(";\n"):
                conn.execute(statement)
        except psycopg.errors.InsufficientPrivilege as e:
            raise BindingError(
                f"walbridge records which Kafka topics hold each slot's data in {wire.META_SCHEMA}.{TABLE} of "
                f"the source database, and role {user} may not create it ({str(e).strip()}). As a superuser run "
                f"GRANT CREATE ON DATABASE {db} TO {user}; or create it for the role:\n{DDL};\n"
                f"GRANT SELECT, INSERT, UPDATE ON {wire.META_SCHEMA}.{TABLE} TO {user};") from None
    try:
        conn.execute(alter)
    except psycopg.errors.InsufficientPrivilege:
        # An administrator's table from before the server columns: the slot's
        # topics are recorded as before, its server is not.
        log.warning("%s.%s lacks the columns that record which PostgreSQL server each slot was read on, and "
                    "role %s may not add them: a failover of the source cannot be told from a reconnect. As the "
                    "table's owner run: %s;", wire.META_SCHEMA, TABLE, user, alter)
    return _columns(conn)


def read(conn: psycopg.Connection, slot: str) -> Binding | None:
    """The slot's binding, or None where none was recorded."""
    if not _columns(conn):
        return None
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(sql.SQL("SELECT * FROM {} WHERE slot_name = %s").format(_ident()), (slot,)).fetchone()
    if row is None:
        return None
    known = row.get("system_identifier") is not None and row.get("timeline") is not None
    return Binding(row["topic_prefix"], row["kafka_cluster_id"],
                   Server(row["system_identifier"], row["timeline"]) if known else None, row.get("resend_until"))


def write(conn: psycopg.Connection, slot: str, binding: Binding, new_slot: bool = False) -> None:
    """Record ``binding``; ``new_slot``: the slot was just created, and what
    was recorded of an earlier slot of the name (its resend mark) goes."""
    values = {"slot_name": slot, "topic_prefix": binding.topic_prefix, "kafka_cluster_id": binding.cluster_id}
    columns = _ensure(conn)
    if set(_SERVER_COLUMNS) <= columns:
        server = binding.server
        values.update(system_identifier=server.system_id if server else None,
                      timeline=server.timeline if server else None)
    if new_slot and "resend_until" in columns:
        values.update(resend_until=None)
    names = [sql.Identifier(c) for c in values]
    try:
        conn.execute(sql.SQL("INSERT INTO {} ({}) VALUES ({}) ON CONFLICT (slot_name) DO UPDATE SET ({}) = ({}), "
                             "bound_at = now()").format(
            _ident(), sql.SQL(", ").join(names), sql.SQL(", ").join(sql.Placeholder() * len(names)),
            sql.SQL(", ").join(names[1:]), sql.SQL(", ").join(sql.SQL("excluded.{}").format(n) for n in names[1:])),
            list(values.values()))
    except psycopg.errors.InsufficientPrivilege as e:
        raise BindingError(
            f"role {conn.info.user} may not write {wire.META_SCHEMA}.{TABLE} ({str(e).strip()}): as its owner run "
            f"GRANT SELECT, INSERT, UPDATE ON {wire.META_SCHEMA}.{TABLE} TO {conn.info.user};") from None


def mark_resend(conn: psycopg.Connection, slot: str, upto: int) -> None:
    """Record that a run's Kafka deliveries failed with changes up to commit
    LSN ``upto`` produced: until a run confirms past it, runs re-send their
    whole replay (see ``producer.pipeline._Runs``). Kept here so that a
    process killed before such a run still knows it. Raises psycopg's error
    where it cannot be written (no column: an administrator's older table)."""
    conn.execute(sql.SQL("UPDATE {} SET resend_until = greatest(resend_until, %s) WHERE slot_name = %s").format(
        _ident()), (upto, slot))


def clear_resend(conn: psycopg.Connection, slot: str, confirmed: int) -> None:
    """Forget a resend mark that ``confirmed`` (the slot's confirmed position) has passed."""
    conn.execute(sql.SQL("UPDATE {} SET resend_until = NULL WHERE slot_name = %s AND resend_until <= %s").format(
        _ident()), (slot, confirmed))
