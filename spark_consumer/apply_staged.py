"""The staged (parallel) apply: each executor task plans its parts and COPYs
them into staging tables of their own (:func:`stage_part`, one transaction
per part, in parallel); the driver then applies every staged part of the
micro-batch and moves progress in ONE transaction (:func:`commit_batch`).

Layout in the target database: ``_walbridge.staged_parts`` (UNLOGGED, one row
per staged part: its offsets, staging table and what planning counted) and
``_walbridge."stage_<hash>"`` (UNLOGGED, one per staged part, named by
:func:`staging_table_name`); both are created by
:func:`spark_consumer.progress.ensure_progress`.

Invariants:
- Nothing staged is visible in the target before :func:`commit_batch`, which
  keeps the driver apply's guarantees (:mod:`spark_consumer.apply_driver`): one
  transaction that locks the parts' progress, applies only the staged rows
  progress does not cover yet, moves progress and drops the staging.
- Staging the same part again (a replayed batch, a retried task) replaces the
  earlier staging; a part that is not staged makes :func:`commit_batch` raise
  :class:`StagingMissingError`, and the retried batch stages it again.
- Staging left behind by crashes (parts progress now covers, UNLOGGED tables
  emptied by a server crash) is dropped by :func:`drop_stale_staging`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from schemas import wire
from spark_consumer.apply_plan import (
    DEFAULT_GC_CONTROLS,
    STAGE_EXTRA,
    Position,
    ShapeTarget,
    classify_cuts,
    make_cut,
    plan_batch,
    split_replayed,
)
from spark_consumer.batch import (
    PLAN_COUNTS,
    BatchResult,
    Part,
    PartResult,
    add_counts,
    check_range,
    fill_results,
    plan_counts,
    progress_update,
)
from spark_consumer.progress import check_gap, lock_progress, read_part_progress, write_progress
from spark_consumer.staging import copy_rows, plan_rows, stage_select, temp_stage
from spark_consumer.statements import apply_stage, record_backfills


class StagingMissingError(RuntimeError):
    """``commit_batch`` was asked for a part that is not (or no longer) staged."""


def staging_table_name(group: str, topic: str, partition: int, end: int) -> str:
    """The UNLOGGED staging table of one part: named by (group, topic,
    partition, end offset) of the micro-batch, so a replay recreates it."""
    digest = hashlib.sha1(f"{group}\x00{topic}\x00{partition}\x00{end}".encode()).hexdigest()[:20]
    return f"stage_{digest}"


@dataclass(frozen=True)
class StagedPart:
    topic: str
    partition: int
    start: int
    end: int
    table: str
    rows: int  # planned rows staged
    skipped_replayed: int


def stage_part(conn: psycopg.Connection, group: str, target: ShapeTarget, part: Part, *,
               on_offset_reset: str = "raise", gc_controls: Iterable[str] = DEFAULT_GC_CONTROLS) -> StagedPart:
    """Executor side of the staged apply: plan one part and COPY it into its
    own UNLOGGED staging table, in a transaction of its own (so executors stage
    in parallel, each on its connection). Nothing becomes visible in the
    target: :func:`commit_batch` decides. Staging the same part again (a
    replayed batch, a retried task) replaces the earlier staging."""
    name = staging_table_name(group, part.topic, part.partition, part.end)
    ident = sql.Identifier(wire.META_SCHEMA, name)
    check_range(part)
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT set_config('TimeZone', 'UTC', true)")
        prog = read_part_progress(conn, group, part.topic, part.partition, part.topic_id)
        todo, skipped, reset = split_replayed(part.rows, prog, where=f"{part.topic}[{part.partition}]",
                                              on_offset_reset=on_offset_reset, fields=part.fields)
        floors = {part.partition: prog.floor} if prog is not None and prog.floor is not None else {}
        plan = plan_batch(target, todo, floors=floors, gc_controls=gc_controls, fields=part.fields)
        cur.execute("SET LOCAL client_min_messages = warning")
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))
        cur.execute(sql.SQL("CREATE UNLOGGED TABLE {} AS ").format(ident) + stage_select(target))
        copy_rows(conn, target, ident, plan_rows(plan, with_cuts=True))
        st = plan.stats.get(part.tp)
        info = {
            "rows": len(part.rows), "skipped_replayed": skipped, "offset_reset": reset, "planned": len(plan.stage_rows),
            **plan_counts(st),
            "max_position": list(st.max_position) if st and st.max_position else None,
            "controls": [_jsonable(c) for c in plan.controls],
        }
        cur.execute(
            f"INSERT INTO {wire.META_SCHEMA}.staged_parts (consumer_group, topic, partition, end_offset, "
            "start_offset, stage_table, shape, info) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (consumer_group, topic, partition, end_offset) DO UPDATE SET "
            "start_offset = EXCLUDED.start_offset, stage_table = EXCLUDED.stage_table, shape = EXCLUDED.shape, "
            "info = EXCLUDED.info, staged_at = now()",
            (group, part.topic, part.partition, part.end, part.start, name, target.shape,
             Jsonb(info)))
    return StagedPart(part.topic, part.partition, part.start, part.end, name, len(plan.stage_rows), skipped)


def _info_pos(info: Mapping) -> Position | None:
    return tuple(info["max_position"]) if info.get("max_position") else None


def _jsonable(row: Mapping) -> dict:
    out = {}
    for k, v in row.items():
        if k.startswith(wire.RESERVED_PREFIX):
            out[k] = v if isinstance(v, (str, int, float, bool, type(None), list)) else str(v)
    return out


def commit_batch(conn: psycopg.Connection, group: str, batches: Sequence[tuple[ShapeTarget, Sequence[Part]]], *,
                 on_gap: str = "raise") -> BatchResult:
    """Driver side of the staged apply: in ONE transaction, lock the parts'
    progress, apply every staged part not yet covered by it, advance progress,
    drop the staging tables. ``batches`` names the parts (their rows are not
    needed). Raises :class:`StagingMissingError` if a part was not staged (the
    batch must be retried, which re-stages it)."""
    result = BatchResult()
    all_parts = [p for _, parts in batches for p in parts]
    if not all_parts:
        return result
    with conn.transaction(), conn.cursor() as cur:
        progress, existed = lock_progress(conn, group, all_parts)
        metas = {(r[0], r[1]): r for r in cur.execute(
            f"SELECT topic, partition, start_offset, stage_table, info FROM {wire.META_SCHEMA}.staged_parts "
            "WHERE consumer_group = %s AND (topic, partition, end_offset) IN "
            "(SELECT * FROM unnest(%s::text[], %s::int[], %s::bigint[]))",
            (group, [p.topic for p in all_parts], [p.partition for p in all_parts],
             [p.end for p in all_parts])).fetchall()}
        updates = []
        drop = []
        for target, parts in batches:
            if not parts:
                continue
            selects = []
            params: list[Any] = []
            infos = {}
            skipped_parts: set[tuple[str, int]] = set()
            for part in parts:
                meta = metas.get(part.tp)
                if meta is None or meta[2] != part.start:
                    raise StagingMissingError(f"{part.topic}[{part.partition}] [{part.start}, {part.end}) is not "
                                              f"staged for group {group!r}: re-run the batch")
                _, _, _, table, info = meta
                drop.append(table)
                prog = progress[part.tp]
                if part.tp in existed:
                    check_gap(part, prog, on_gap)
                res = result.parts[part.tp] = PartResult(part.topic, part.partition, part.start, part.end,
                                                         rows=info["rows"], offset_reset=info["offset_reset"])
                infos[part.tp] = info
                if not info["offset_reset"] and prog.next_offset >= part.end:
                    res.skipped_replayed = res.rows  # the whole part was applied meanwhile
                    skipped_parts.add(part.tp)
                    continue
                res.skipped_replayed = info["skipped_replayed"]
                add_counts(res, {name: info[name] for name in PLAN_COUNTS})
                result.controls.extend(info["controls"])
                cond = sql.SQL("TRUE")
                if not info["offset_reset"]:
                    cond = sql.SQL("_wb_offset >= %s")
                    params.append(prog.next_offset)
                if prog.floor is not None:
                    # Cut events below the floor still count (a backfill_end must be
                    # recorded); their deletes find nothing the floor's cut left.
                    cond = cond + sql.SQL(" AND (_wb_kind = 't' OR (_wb_lsn, _wb_op_index) >= (%s, %s))")
                    params.extend(prog.floor)
                selects.append(sql.SQL("SELECT * FROM {} WHERE {}").format(
                    sql.Identifier(wire.META_SCHEMA, table), cond))
            if not selects:
                for part in parts:
                    updates.append(progress_update(part, progress[part.tp], result.parts[part.tp],
                                                   _info_pos(infos[part.tp]), None))
                continue
            union = sql.SQL(" UNION ALL ").join(selects)
            stage = temp_stage(conn, target)
            cols = sql.SQL(", ").join(sql.Identifier(c) for c in (*target.names, *STAGE_EXTRA))
            cuts, scoped_cuts, backfill_ends = classify_cuts(
                make_cut(p, lsn, op, off, keep[0], json.loads(keep[1]) if len(keep) > 1 and keep[1] else None)
                for p, lsn, op, off, keep in cur.execute(sql.SQL(
                    "SELECT _wb_partition, _wb_lsn, _wb_op_index, _wb_offset, _wb_keep FROM ({}) q "
                    "WHERE _wb_kind = 't'").format(union), params).fetchall())
            if target.keyless:
                fill = sql.SQL("INSERT INTO {s} ({cols}) SELECT {cols} FROM ({u}) q WHERE _wb_kind <> 't'").format(
                    s=stage, cols=cols, u=union)
            else:
                # Keys live on one partition, unless the topic was repartitioned:
                # across parts, too, the highest position wins.
                keys = sql.SQL(", ").join(sql.Identifier(k) for k in target.key_columns)
                fill = sql.SQL("INSERT INTO {s} ({cols}) SELECT DISTINCT ON ({keys}) {cols} FROM ({u}) q "
                               "WHERE _wb_kind <> 't' ORDER BY {keys}, _wb_lsn DESC, _wb_op_index DESC, "
                               "_wb_partition DESC, _wb_offset DESC").format(keys=keys, s=stage, cols=cols,
                                                                             u=union)
            cur.execute(fill, params)
            staged: dict[int, Counter] = defaultdict(Counter)
            for p, kind, n in cur.execute(sql.SQL("SELECT _wb_partition, _wb_kind, count(*) FROM {} GROUP BY 1, 2")
                                          .format(stage)).fetchall():
                staged[p][kind] = n
            # Staged rows the current progress covers count as replayed; rows
            # dropped by DISTINCT ON as superseded.
            in_union: dict[int, int] = defaultdict(int)
            for p, n in cur.execute(sql.SQL("SELECT _wb_partition, count(*) FROM ({}) q WHERE _wb_kind <> 't' "
                                            "GROUP BY 1").format(union), params).fetchall():
                in_union[p] = n
            keep_sets = [tuple(k) if k else () for (k,) in cur.execute(sql.SQL(
                "SELECT DISTINCT _wb_keep FROM {} WHERE _wb_kind = 'u'").format(stage)).fetchall()]
            applied = apply_stage(cur, target, stage, cuts.values(), keep_sets, staged, scoped_cuts)
            topic = parts[0].topic
            if backfill_ends:
                result.backfills_completed += record_backfills(cur, group, topic, target, backfill_ends)
            for part in parts:
                res = result.parts[part.tp]
                if part.tp not in skipped_parts:
                    res.superseded += in_union[part.partition] - sum(staged[part.partition].values())
                    res.skipped_replayed += max(0, infos[part.tp]["planned"] - in_union[part.partition])
            fill_results(result.parts, topic, staged, applied)
            for part in parts:
                updates.append(progress_update(part, progress[part.tp], result.parts[part.tp],
                                               _info_pos(infos[part.tp]), cuts.get(part.partition)))
        write_progress(conn, group, updates)
        for table in drop:
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(wire.META_SCHEMA, table)))
        cur.execute(
            f"DELETE FROM {wire.META_SCHEMA}.staged_parts WHERE consumer_group = %s "
            "AND (topic, partition, end_offset) IN (SELECT * FROM unnest(%s::text[], %s::int[], %s::bigint[]))",
            (group, [p.topic for p in all_parts], [p.partition for p in all_parts], [p.end for p in all_parts]))
    return result


def drop_stale_staging(conn: psycopg.Connection, group: str | None = None) -> int:
    """Drop staging left behind by crashes: parts whose offsets progress now
    covers, and staging tables without a ``staged_parts`` row (after a server
    crash, which empties UNLOGGED tables). Returns the number dropped."""
    dropped = 0
    with conn.transaction(), conn.cursor() as cur:
        q = ("SELECT s.consumer_group, s.topic, s.partition, s.end_offset, s.stage_table "
             f"FROM {wire.META_SCHEMA}.staged_parts s JOIN {wire.META_SCHEMA}.progress g "
             "USING (consumer_group, topic, partition) WHERE g.next_offset >= s.end_offset")
        params: list[Any] = []
        if group is not None:
            q += " AND s.consumer_group = %s"
            params.append(group)
        for g, t, p, e, table in cur.execute(q, params).fetchall():
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(wire.META_SCHEMA, table)))
            cur.execute(f"DELETE FROM {wire.META_SCHEMA}.staged_parts WHERE consumer_group = %s AND topic = %s "
                        "AND partition = %s AND end_offset = %s", (g, t, p, e))
            dropped += 1
        orphans = cur.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            f"WHERE n.nspname = %s AND c.relkind = 'r' AND c.relname LIKE 'stage\\_%%' AND NOT EXISTS "
            f"(SELECT 1 FROM {wire.META_SCHEMA}.staged_parts s WHERE s.stage_table = c.relname)",
            (wire.META_SCHEMA,)).fetchall()
        for (table,) in orphans:
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(wire.META_SCHEMA, table)))
            dropped += 1
    return dropped
