"""Which Kafka topics hold a replication slot's data, recorded in the source
database itself: the one record that survives a broker that lost everything.

Invariants:
- ``_walbridge.producer_slots`` holds, per slot, the topic prefix and the
  Kafka cluster id its data went to. It is written when the slot is created
  (and adopted, with the running config, by a slot from before it existed),
  and read at every start: a slot bound elsewhere is never dropped nor its
  database re-snapshotted by a changed config (see :mod:`producer.recovery`).
- A role that may not create the table stops the producer with the grant (or
  the table's DDL) it needs; nothing here guesses.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from producer.recovery import Binding
from schemas import wire

TABLE = "producer_slots"
DDL = f"""CREATE SCHEMA IF NOT EXISTS {wire.META_SCHEMA};
CREATE TABLE IF NOT EXISTS {wire.META_SCHEMA}.{TABLE} (
    slot_name text PRIMARY KEY,
    topic_prefix text NOT NULL,
    kafka_cluster_id text,
    bound_at timestamptz NOT NULL DEFAULT now()
)"""


class BindingError(RuntimeError):
    """The slot's binding cannot be read or recorded."""


def _ident() -> sql.Composable:
    return sql.Identifier(wire.META_SCHEMA, TABLE)


def _exists(conn: psycopg.Connection) -> bool:
    return conn.execute("SELECT to_regclass(%s)", (f"{wire.META_SCHEMA}.{TABLE}",)).fetchone()[0] is not None


def _ensure(conn: psycopg.Connection) -> None:
    if _exists(conn):
        return  # created before (perhaps by an administrator: CREATE SCHEMA would need a grant)
    try:
        for statement in DDL.split(";\n"):
            conn.execute(statement)
    except psycopg.errors.InsufficientPrivilege as e:
        user, db = conn.info.user, conn.info.dbname
        raise BindingError(
            f"walbridge records which Kafka topics hold each slot's data in {wire.META_SCHEMA}.{TABLE} of the "
            f"source database, and role {user} may not create it ({str(e).strip()}). As a superuser run "
            f"GRANT CREATE ON DATABASE {db} TO {user}; or create it for the role:\n{DDL};\n"
            f"GRANT SELECT, INSERT, UPDATE ON {wire.META_SCHEMA}.{TABLE} TO {user};") from None


def read(conn: psycopg.Connection, slot: str) -> Binding | None:
    """The slot's binding, or None where none was recorded."""
    if not _exists(conn):
        return None
    row = conn.execute(sql.SQL("SELECT topic_prefix, kafka_cluster_id FROM {} WHERE slot_name = %s").format(_ident()),
                       (slot,)).fetchone()
    return Binding(row[0], row[1]) if row else None


def write(conn: psycopg.Connection, slot: str, binding: Binding) -> None:
    _ensure(conn)
    try:
        conn.execute(sql.SQL(
            "INSERT INTO {} (slot_name, topic_prefix, kafka_cluster_id) VALUES (%s, %s, %s) "
            "ON CONFLICT (slot_name) DO UPDATE SET topic_prefix = excluded.topic_prefix, "
            "kafka_cluster_id = excluded.kafka_cluster_id, bound_at = now()").format(_ident()),
            (slot, binding.topic_prefix, binding.cluster_id))
    except psycopg.errors.InsufficientPrivilege as e:
        raise BindingError(
            f"role {conn.info.user} may not write {wire.META_SCHEMA}.{TABLE} ({str(e).strip()}): as its owner run "
            f"GRANT SELECT, INSERT, UPDATE ON {wire.META_SCHEMA}.{TABLE} TO {conn.info.user};") from None
