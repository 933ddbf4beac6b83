"""The set-based statements that carry a staged plan into the shape's table
and its tombstones (:func:`apply_stage`, or :func:`insert_new_keys` when the
plan only brings keys the target has never seen), the record and final GC of
backfills (:func:`record_backfills`) and the GC of tombstones
(:func:`gc_tombstones`). Each statement handles every row of the stage at once.

Invariants:
- Every write is guarded by position: an upsert lands only where the target
  row's position is lower and no tombstone has an equal or higher one; a delete
  removes only an older row and leaves a tombstone; a cut removes only rows of
  its partition below it. So apply is idempotent and order-independent per key
  even when progress cannot help (offset reset with ``on_offset_reset="follow"``,
  keys that moved between partitions).
- A NULL position (a target row written behind walbridge's back) is lower
  than every position: any change or backfill row overwrites (or deletes) it.
- Cuts run after the batch's writes. A scoped ``backfill_end`` (see
  :mod:`spark_consumer.apply_plan`) deletes rows and tombstones of its
  partition in its key buckets (:func:`schemas.buckets.in_scope`, under
  ``SESSION_SETTINGS``) below its position, and leaves the floor alone.
- Final GC: the transaction that applies a backfill's ``backfill_end`` on the
  last of its ``partitions`` also deletes every target row in its scope (any
  ``_wb_partition``, NULL included) whose position is below the backfill's
  start ``(S, 0)`` or NULL, and the tombstones in scope below it, and sets
  ``completed_at`` (once: a completed backfill is never collected again).
  ``BatchResult.backfills_completed`` reports it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from schemas import wire
from schemas.buckets import SESSION_SETTINGS, in_scope
from spark_consumer.apply_plan import DELETE, UPSERT, ApplyPlan, Cut, Position
from spark_consumer.batch import BackfillGC
from spark_consumer.multiset import Candidate, Taker, pair
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.staging import STAGED_BOOKKEEPING, copy_rows
from spark_consumer.target_layout import APPLIED_AT, BOOKKEEPING_COLUMNS, table_ident, tombstones_ident


def upsert_keys(plan: ApplyPlan) -> list[int] | None:
    """The keys of the plan's upserts, for a shape with one key column whose
    values are all ``int`` (None otherwise)."""
    target = plan.target
    if target.keyless or len(target.key_columns) != 1:
        return None
    n = len(target.columns)
    k = next(i for i, c in enumerate(target.columns) if c.is_key)
    keys = [t[k] for t in plan.stage_rows if t[n] == UPSERT]
    if not keys or set(map(type, keys)) != {int}:
        return None
    return keys


# A target table's row-level security flag and column types (name, type oid).
_TABLE_FACTS = ("SELECT c.relrowsecurity, array_agg(a.attname::text), array_agg(a.atttypid::int) FROM pg_class c "
                "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
                "WHERE c.oid = %s::regclass GROUP BY c.relrowsecurity")


def only_new_keys(conn: psycopg.Connection,
                  asks: Sequence[tuple[ShapeTarget, ApplyPlan, Mapping[int, Counter], list[int] | None]]
                  ) -> list[tuple[dict[str, int] | None, bool | None]]:
    """For each shape of a batch (its target, plan, staged kinds and
    :func:`upsert_keys`): is the plan upserts only (no deletes, cuts or kept
    TOAST columns) of keys neither the target nor its tombstones hold? Then
    each is an insert and nothing else can happen to the target (a snapshot
    or backfill into an empty or disjoint table, appends of new keys).
    Answers, in order: the target table's column types (name → type oid) if
    so, else None; and whether the table holds any of the keys, when it was
    asked (else None). Every shape's questions are sent together
    (:func:`_first_rows`), before any is written: a batch of many shapes
    waits for two or three answers, not two a shape, and a table more than
    one entry writes is not asked (what the first writes would make the
    answer stale; its entries take the stage's statements)."""
    out: list[tuple[dict[str, int] | None, bool | None]] = [(None, None)] * len(asks)
    writers = Counter((target.schema, target.table) for target, *_ in asks)
    asked = [i for i, (target, plan, staged, keys) in enumerate(asks)
             if writers[target.schema, target.table] == 1 and _upserts_only(plan, staged, keys)]
    facts = _first_rows(conn, [(_TABLE_FACTS, (table_ident(asks[i][0]).as_string(conn),)) for i in asked])
    # COPY FROM refuses a table under row-level security: such a table takes
    # the stage's INSERT, which applies its policies.
    probed = [(i, dict(zip(row[1], row[2]))) for i, row in zip(asked, facts) if row is not None and not row[0]]
    held = _key_holders(conn, [(asks[i][0], asks[i][3], types.get(asks[i][0].key_columns[0])) for i, types in probed],
                        tombstones=True)
    for (i, types), (in_table, in_tombstones) in zip(probed, held):
        out[i] = (None if in_table or in_tombstones else types), in_table
    return out


def _upserts_only(plan: ApplyPlan, staged: Mapping[int, Counter], upsert_keys: list[int] | None) -> bool:
    """Pure: could :func:`only_new_keys` say yes (before asking the target)?"""
    if upsert_keys is None or plan.cuts or plan.scoped_cuts or any(k not in ((), None) for k in plan.keep_sets):
        return False
    return not any(kind != UPSERT for counts in staged.values() for kind, c in counts.items() if c)


def _first_rows(conn: psycopg.Connection, queries: Sequence[tuple[Any, tuple]]) -> list[tuple | None]:
    """The first row of each query, all sent before any answer is awaited
    (psycopg's pipeline mode: one round trip for all, not one each)."""
    if not queries:
        return []
    with conn.pipeline():
        cursors = [conn.execute(query, params) for query, params in queries]
    return [cur.fetchone() for cur in cursors]


def insert_new_keys(conn: psycopg.Connection, target: ShapeTarget, plan: ApplyPlan,
                    staged: Mapping[int, Counter], types: Mapping[str, int]) -> dict[str, Counter]:
    """:func:`only_new_keys` plans (``types``: what it returned): COPY the rows
    straight into the target, as the stage's INSERT would write them
    (``_wb_applied_at``: its default, ``now()``)."""
    n = len(target.columns)
    copy_rows(conn, target, table_ident(target), [t[:n] + t[n + 2:] for t in plan.stage_rows],
              (*target.names, *STAGED_BOOKKEEPING), types=types)
    return {"deleted": Counter(), "tombstoned": Counter(), "truncated": Counter(), "tombstones_dropped": Counter(),
            "upserted": Counter({p: c[UPSERT] for p, c in staged.items()})}


def apply_stage(cur: psycopg.Cursor, target: ShapeTarget, stage: sql.Identifier, cuts: Iterable[Cut],
                keep_sets: Iterable[tuple[str, ...]], staged: Mapping[int, Counter],
                scoped_cuts: Iterable[Cut] = (), upserted_keys: list[int] | None = None,
                stage_types: Mapping[str, int] | None = None, holds_keys: bool | None = None) -> dict[str, Counter]:
    """``staged``: per partition, the stage's rows by kind (exact: statements
    for kinds it lacks are skipped); ``stage_types``: the stage's column
    types, when known (its key column's is the target's); ``holds_keys``:
    whether the target holds any of ``upserted_keys``, when known (see
    :func:`only_new_keys`)."""
    if target.keyless:
        out = _apply_keyless(cur, target, stage)
    else:
        out = _apply_keyed(cur, target, stage, keep_sets, sum(c[UPSERT] for c in staged.values()),
                           sum(c[DELETE] for c in staged.values()), upserted_keys,
                           (stage_types or {}).get(target.key_columns[0]), holds_keys)
    # Cuts last: the plan holds nothing of a cut's partition below the cut, so
    # what the batch wrote there survives it, and rows a re-snapshot rewrites
    # are updated in place instead of deleted and inserted again.
    # Scoped cuts too: in-scope rows the batch wrote below one are gone with it.
    truncated, dropped = _apply_cuts(cur, target, cuts)
    s_truncated, s_dropped = _apply_scoped_cuts(cur, target, scoped_cuts)
    out["truncated"] = truncated + s_truncated
    out["tombstones_dropped"] = dropped + s_dropped
    return out


def _apply_keyed(cur: psycopg.Cursor, target: ShapeTarget, stage: sql.Identifier,
                 keep_sets: Iterable[tuple[str, ...]], n_upserts: int | None = None, n_deletes: int | None = None,
                 upsert_keys: list[int] | None = None, key_type: int | None = None,
                 holds_keys: bool | None = None) -> dict[str, Counter]:
    """``n_upserts``/``n_deletes``: how many the stage holds, when known (a
    statement for a kind the stage lacks is skipped); ``upsert_keys``: the
    upserted keys, when the shape has one integer key column; ``key_type``:
    its type oid, and ``holds_keys``: whether the target holds any of them,
    when :func:`only_new_keys` asked (it asks only of batches without deletes)."""
    t, tb = table_ident(target), tombstones_ident(target)
    keys = sql.SQL(", ").join(sql.Identifier(k) for k in target.key_columns)
    s_keys = sql.SQL(", ").join(sql.SQL("s.{}").format(sql.Identifier(k)) for k in target.key_columns)
    out: dict[str, Counter] = {"deleted": Counter(), "tombstoned": Counter(), "upserted": Counter()}
    if n_deletes != 0:
        _apply_deletes(cur, target, stage, out, t, tb, keys, s_keys)
    if n_upserts == 0:
        return out
    # Upserts: a newer upsert lifts an older tombstone; an equal or newer one wins.
    cur.execute(sql.SQL(
        "DELETE FROM {tb} AS tb USING {s} AS s WHERE s._wb_kind = 'u' AND {eq} AND {lt}"
    ).format(tb=tb, s=stage, eq=_key_eq(target, "tb", "s"), lt=_pos_lt("tb", "s", a_changes=True)))
    names = target.names
    all_cols, s_cols = _insert_columns(target)
    # Keys the target holds: update where the change is newer. A statement per
    # set of kept (unchanged TOAST) columns, which it leaves alone. None when
    # the target holds none of the upserted keys (e.g. a snapshot into an
    # empty or disjoint table): the join would find nothing.
    upserted = Counter()
    if upsert_keys is not None and holds_keys is None:
        holds_keys = _holds_any_key(cur, target, upsert_keys, key_type=key_type)
    for keep in keep_sets if upsert_keys is None or holds_keys else ():
        kept = set(keep)
        sets = [sql.SQL("{c} = s.{c}").format(c=sql.Identifier(c))
                for c in (*[n for n, col in zip(names, target.columns) if not col.is_key and n not in kept],
                          *STAGED_BOOKKEEPING)]
        sets.append(sql.SQL("{} = now()").format(sql.Identifier(APPLIED_AT)))
        upserted += _counts(cur, sql.SQL(
            "UPDATE {t} AS t SET {sets} FROM {s} AS s "
            "WHERE s._wb_kind = 'u' AND s._wb_keep IS NOT DISTINCT FROM %s::text[] AND {eq} AND {lt} "
            "RETURNING s._wb_partition"
        ).format(t=t, sets=sql.SQL(", ").join(sets), s=stage, eq=_key_eq(target, "t", "s"), lt=_pos_lt("t", "s")),
            (list(keep) if keep else None,))
    # New keys (not live, not tombstoned at an equal or newer position): insert.
    # A plain INSERT, not ON CONFLICT: progress locks serialize the writers of
    # a partition, and keys stay on their partition; should two appliers ever
    # race on a key, the loser's transaction fails and its batch is retried.
    if n_upserts is not None and sum(upserted.values()) >= n_upserts:
        out["upserted"] = upserted  # every key existed and was updated: nothing to insert
        return out
    upserted += _counts(cur, sql.SQL(
        "INSERT INTO {t} ({cols}) SELECT {s_cols} FROM {s} AS s WHERE s._wb_kind = 'u' "
        "AND NOT EXISTS (SELECT 1 FROM {t} AS t WHERE {eq_t}) "
        "AND NOT EXISTS (SELECT 1 FROM {tb} AS tb WHERE {eq_tb}) RETURNING _wb_partition"
    ).format(t=t, cols=all_cols, s_cols=s_cols, s=stage, eq_t=_key_eq(target, "t", "s"),
             tb=tb, eq_tb=_key_eq(target, "tb", "s")))
    out["upserted"] = upserted
    return out


def _apply_deletes(cur: psycopg.Cursor, target: ShapeTarget, stage: sql.Identifier, out: dict[str, Counter],
                   t: sql.Composable, tb: sql.Composable, keys: sql.Composable, s_keys: sql.Composable) -> None:
    # Deletes: remove older live rows, then tombstone every delete no live row outranks.
    out["deleted"] = _counts(cur, sql.SQL(
        "DELETE FROM {t} AS t USING {s} AS s WHERE s._wb_kind = 'd' AND {eq} AND {lt} RETURNING s._wb_partition"
    ).format(t=t, s=stage, eq=_key_eq(target, "t", "s"), lt=_pos_lt("t", "s")))
    out["tombstoned"] = _counts(cur, sql.SQL(
        "INSERT INTO {tb} AS tb ({keys}, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset, _wb_applied_at) "
        "SELECT {s_keys}, s._wb_lsn, s._wb_op_index, s._wb_partition, s._wb_offset, now() FROM {s} AS s "
        "WHERE s._wb_kind = 'd' AND NOT EXISTS (SELECT 1 FROM {t} AS t WHERE {eq}) "
        "ON CONFLICT ({keys}) DO UPDATE SET _wb_lsn = EXCLUDED._wb_lsn, _wb_op_index = EXCLUDED._wb_op_index, "
        "_wb_partition = EXCLUDED._wb_partition, _wb_offset = EXCLUDED._wb_offset, "
        "_wb_applied_at = EXCLUDED._wb_applied_at "
        "WHERE {tbpos} < (EXCLUDED._wb_lsn, EXCLUDED._wb_op_index) "
        "RETURNING tb._wb_partition"
    ).format(tb=tb, keys=keys, s_keys=s_keys, s=stage, t=t, eq=_key_eq(target, "t", "s"), tbpos=_pos("tb")))


def _holds_any_key(cur: psycopg.Cursor, target: ShapeTarget, keys: list[int], *, key_type: int | None) -> bool:
    """Does the target hold any of ``keys``? (:func:`_key_holders`)"""
    return _key_holders(cur.connection, [(target, keys, key_type)])[0][0]


def _key_holders(conn: psycopg.Connection, asks: Sequence[tuple[ShapeTarget, list[int], int | None]],
                 tombstones: bool = False) -> list[tuple[bool, ...]]:
    """For each (target, keys, key_type): does the target (and, with
    ``tombstones``, do its tombstones) hold any of ``keys``? One answer per
    table; True unless its key column is an integer column holding none
    (``key_type``: its type oid, from the table's or the stage's column
    types; None counts as not an integer). A probe of the keys' range first
    (one index lookup, enough for appends with rising keys), then the keys
    themselves in the tables whose range holds any (for a snapshot, whose
    partitions interleave the parallel readers' key ranges). Each step's
    probes of every table go together (:func:`_first_rows`)."""
    held: list[list[bool]] = []
    # (the ask, the table's place in its answer, the table, its key column)
    tables: list[tuple[int, int, sql.Composable, sql.Identifier]] = []
    for i, (target, _, key_type) in enumerate(asks):
        own = [table_ident(target)] + ([tombstones_ident(target)] if tombstones else [])
        integer = key_type in (20, 21, 23)
        held.append([not integer] * len(own))
        if integer:
            [key] = target.key_columns
            tables += [(i, j, t, sql.Identifier(key)) for j, t in enumerate(own)]

    def each_holds(condition: str, params: Callable[[list[int]], tuple], among: list[tuple]) -> list[bool]:
        return [row[0] for row in _first_rows(conn, [
            (sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE {} " + condition + ")").format(t, key), params(asks[i][1]))
            for i, _, t, key in among])]

    in_range = each_holds("BETWEEN %s::bigint AND %s::bigint", lambda keys: (min(keys), max(keys)), tables)
    probe = [t for t, hit in zip(tables, in_range) if hit]
    for (i, j, _, _), hit in zip(probe, each_holds("= ANY(%s::bigint[])", lambda keys: (keys,), probe)):
        held[i][j] = hit
    return [tuple(h) for h in held]


def _insert_columns(target: ShapeTarget) -> tuple[sql.Composable, sql.Composable]:
    """The target table's column list for an INSERT, and the matching select
    list from the stage aliased ``s`` (bookkeeping columns included)."""
    names = target.names
    all_cols = sql.SQL(", ").join(sql.Identifier(c) for c in (*names, *BOOKKEEPING_COLUMNS))
    s_cols = sql.SQL(", ").join([sql.SQL("s.{}").format(sql.Identifier(c)) for c in names]
                                + [sql.SQL("now()") if c == APPLIED_AT else sql.SQL("s.{}").format(sql.Identifier(c))
                                   for c in BOOKKEEPING_COLUMNS])
    return all_cols, s_cols


def _apply_keyless(cur: psycopg.Cursor, target: ShapeTarget, stage: sql.Identifier) -> dict[str, Counter]:
    """Appends and removals of whole rows (:mod:`spark_consumer.multiset` says
    which equal row a removal takes). Every removal is kept in the tombstones:
    waiting for its row (took NULL), or with the rank of the row it took."""
    t, tb = table_ident(target), tombstones_ident(target)
    all_cols, s_cols = _insert_columns(target)
    sc, tc = _content(target, "s"), _content(target, "t")
    took = sql.SQL(", ").join(sql.Identifier(c) for c in wire.TOOK_COLUMNS)
    out: dict[str, Counter] = {"cancelled": Counter(), "deleted": Counter(), "tombstoned": Counter()}

    # Staged appends that a kept removal takes: its row, which arrived after
    # it (waiting removal), or a re-read copy of the row it took. The gate
    # spares an append-only table (no removal kept) the content of each row.
    appends = []
    if cur.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {tb})").format(tb=tb)).fetchone()[0]:
        appends = [Candidate(ctid, c, tuple(rank), (p, off), not streamed)
                   for ctid, c, *rank, streamed, p, off in cur.execute(sql.SQL(
                       "SELECT s.ctid, {sc}, {rank}, s._wb_snapshot_id IS NULL, s._wb_partition, s._wb_offset "
                       "FROM {s} AS s WHERE s._wb_kind = 'a' AND {sc} IN (SELECT tb._wb_row FROM {tb} AS tb)").format(
                           sc=sc, rank=_rank_columns("s"), s=stage, tb=tb)).fetchall()]
    if appends:
        kept = [Taker((lsn, opi), c, (lsn, opi, True), None if tl is None else (tl, to, ts))
                for c, lsn, opi, tl, to, ts in cur.execute(sql.SQL(
                    "SELECT _wb_row, _wb_lsn, _wb_op_index, {took} FROM {tb} WHERE _wb_row = ANY(%s)").format(
                        took=took, tb=tb), (list({a.content for a in appends}),)).fetchall()]
        taken = pair(kept, appends)
        if taken:
            moved = [(k, c) for k, c in taken.items()]
            cur.execute(sql.SQL(
                "UPDATE {tb} AS tb SET ({took}) = (m.l, m.o, m.st) FROM unnest(%s::bigint[], %s::bigint[], "
                "%s::bigint[], %s::bigint[], %s::boolean[]) AS m(rl, ro, l, o, st) "
                "WHERE (tb._wb_lsn, tb._wb_op_index) = (m.rl, m.ro)").format(tb=tb, took=took),
                ([k[0] for k, _ in moved], [k[1] for k, _ in moved], [c.rank[0] for _, c in moved],
                 [c.rank[1] for _, c in moved], [c.rank[2] for _, c in moved]))
            out["cancelled"] = _counts(cur, sql.SQL(
                "DELETE FROM {s} AS s WHERE s.ctid = ANY(%s::tid[]) RETURNING s._wb_partition").format(s=stage),
                ([c.id for c in taken.values()],))
    # Appends first: a removal later in the batch (on any partition) may take them.
    out["appended"] = _counts(cur, sql.SQL(
        "INSERT INTO {t} AS t ({cols}) SELECT {s_cols} FROM {s} AS s WHERE s._wb_kind = 'a' "
        "ON CONFLICT (_wb_lsn, _wb_op_index) WHERE _wb_snapshot_id IS NULL DO NOTHING RETURNING t._wb_partition"
    ).format(t=t, cols=all_cols, s_cols=s_cols, s=stage))
    removals = cur.execute(sql.SQL(
        "SELECT {sc}, s._wb_lsn, s._wb_op_index, s._wb_partition, s._wb_offset FROM {s} AS s "
        "WHERE s._wb_kind = 'x' AND NOT EXISTS (SELECT 1 FROM {tb} AS tb "  # kept: applied before (a replay)
        "  WHERE (tb._wb_lsn, tb._wb_op_index) = (s._wb_lsn, s._wb_op_index))").format(
            sc=sc, s=stage, tb=tb)).fetchall()
    if not removals:
        return out
    rows = [Candidate(ctid, c, tuple(rank), (p, off)) for ctid, c, *rank, p, off in cur.execute(sql.SQL(
        "SELECT t.ctid, {tc}, {rank}, t._wb_partition, t._wb_offset FROM {t} AS t WHERE {tc} = ANY(%s)").format(
            tc=tc, rank=_rank_columns("t"), t=t), (list({r[0] for r in removals}),)).fetchall()]
    taken = pair((Taker((lsn, opi), c, (lsn, opi, True)) for c, lsn, opi, _, _ in removals), rows)
    gone = [(taken[(lsn, opi)].id, p) for _, lsn, opi, p, _ in removals if (lsn, opi) in taken]
    if gone:
        out["deleted"] = _counts(cur, sql.SQL(
            "DELETE FROM {t} AS t USING unnest(%s::tid[], %s::int[]) AS m(tid, p) WHERE t.ctid = m.tid "
            "RETURNING m.p").format(t=t), ([g[0] for g in gone], [g[1] for g in gone]))
    took_of = [taken.get((lsn, opi)) for _, lsn, opi, _, _ in removals]
    out["tombstoned"] = Counter(dict(cur.execute(sql.SQL(
        "WITH kept AS (INSERT INTO {tb} (_wb_row, _wb_lsn, _wb_op_index, _wb_partition, _wb_offset, {took}) "
        "SELECT * FROM unnest(%s::text[], %s::bigint[], %s::bigint[], %s::int[], %s::bigint[], %s::bigint[], "
        "%s::bigint[], %s::boolean[]) RETURNING _wb_partition AS p, {first} IS NULL AS waiting) "
        "SELECT p, count(*) FROM kept WHERE waiting GROUP BY p").format(
            tb=tb, took=took, first=sql.Identifier(wire.TOOK_COLUMNS[0])),
        (*(list(col) for col in zip(*removals)), [c and c.rank[0] for c in took_of],
         [c and c.rank[1] for c in took_of], [c and c.rank[2] for c in took_of])).fetchall()))
    return out


def _apply_cuts(cur: psycopg.Cursor, target: ShapeTarget, cuts: Iterable[Cut]) -> tuple[Counter, Counter]:
    cuts = list(cuts)
    if not cuts:
        return Counter(), Counter()
    params = ([c.partition for c in cuts], [c.lsn for c in cuts], [c.op_index for c in cuts])
    src = sql.SQL("unnest(%s::int[], %s::bigint[], %s::bigint[]) AS c(p, l, o)")
    cond = sql.SQL("t._wb_partition = c.p AND {} < (c.l, c.o)").format(_pos("t"))
    truncated = _counts(cur, sql.SQL("DELETE FROM {} AS t USING {} WHERE {} RETURNING c.p").format(
        table_ident(target), src, cond), params)
    dropped = _counts(cur, sql.SQL("DELETE FROM {} AS t USING {} WHERE {} RETURNING c.p").format(
        tombstones_ident(target), src, cond), params)
    return truncated, dropped


def _apply_scoped_cuts(cur: psycopg.Cursor, target: ShapeTarget, cuts: Iterable[Cut]) -> tuple[Counter, Counter]:
    """Scoped backfill_ends: rows (and tombstones) of the cut's partition, in
    its buckets, below it. One statement per cut: each has its own scope."""
    truncated, dropped = Counter(), Counter()
    cuts = list(cuts)
    if cuts:
        _bucket_session(cur)
    for c in cuts:
        tables = [(table_ident(target), truncated)] + ([] if target.keyless else [(tombstones_ident(target), dropped)])
        for table, counter in tables:
            n = cur.execute(sql.SQL("DELETE FROM {} AS t WHERE t._wb_partition = {} AND {} < ({}, {}) AND {}").format(
                table, sql.Literal(c.partition), _pos("t"), sql.Literal(c.lsn), sql.Literal(c.op_index),
                in_scope(c.scope, "t"))).rowcount
            counter[c.partition] += n
    return truncated, dropped


def _bucket_session(cur: psycopg.Cursor) -> None:
    """The settings under which bucket hashes match the source's (for this
    transaction only)."""
    for name, value in SESSION_SETTINGS:
        cur.execute("SELECT set_config(%s, %s, true)", (name, value))


def record_backfills(cur: psycopg.Cursor, group: str, topic: str, target: ShapeTarget,
                     ends: Iterable[Cut]) -> list[BackfillGC]:
    """Record the partitions on which backfill_ends were applied (idempotent:
    a set union). The batch that completes a backfill (every partition done)
    also collects, whatever their partition, the target rows in its scope with
    a position below its start or none, and the tombstones below its start:
    every row the backfill saw was rewritten at its start or later."""
    by_id: dict[str, tuple[Cut, set[int]]] = {}
    for c in ends:
        by_id.setdefault(c.backfill_id, (c, set()))[1].add(c.partition)
    done: list[BackfillGC] = []
    for bid, (cut, partitions) in sorted(by_id.items()):
        info = cut.info
        start = int(info["lsn"]) if info.get("lsn") is not None else cut.lsn
        # The first record's shape, start and scope are the backfill's.
        shape, start, n, done_parts, scope, completed = cur.execute(
            f"INSERT INTO {wire.META_SCHEMA}.backfills AS b (consumer_group, topic, backfill_id, shape, start_lsn, "
            "partitions, partitions_done, scope, rows) VALUES (%s, %s, %s, %s, %s, %s, %s::int[], %s, %s) "
            "ON CONFLICT (consumer_group, topic, backfill_id) DO UPDATE SET partitions_done = "
            "ARRAY(SELECT DISTINCT x FROM unnest(b.partitions_done || EXCLUDED.partitions_done) AS u(x) ORDER BY x), "
            "updated_at = now() "
            "RETURNING shape, start_lsn, partitions, partitions_done, scope, completed_at IS NOT NULL",
            (group, topic, bid, info.get("shape") or target.shape, start, int(info["partitions"]),
             sorted(partitions), Jsonb(cut.scope) if cut.scope else None, info.get("rows"))).fetchone()
        if completed or not set(range(n)) <= set(done_parts):
            continue
        if scope:
            _bucket_session(cur)
        deleted = cur.execute(sql.SQL("DELETE FROM {} AS t WHERE {} < ({}, 0) AND {}").format(
            table_ident(target), _pos("t"), sql.Literal(start), in_scope(scope, "t"))).rowcount
        tombstones = 0
        if not (target.keyless and scope):  # a pending removal's row text cannot be tested for a scope
            tombstones = cur.execute(sql.SQL("DELETE FROM {} AS t WHERE (t._wb_lsn, t._wb_op_index) < ({}, 0) "
                                             "AND {}").format(tombstones_ident(target), sql.Literal(start),
                                                              in_scope(scope, "t"))).rowcount
        cur.execute(f"UPDATE {wire.META_SCHEMA}.backfills SET completed_at = now(), updated_at = now(), "
                    "gc_deleted = %s, gc_tombstones = %s WHERE consumer_group = %s AND topic = %s AND backfill_id = %s",
                    (deleted, tombstones, group, topic, bid))
        done.append(BackfillGC(topic, bid, shape, deleted, tombstones))
    return done


def gc_tombstones(conn: psycopg.Connection, target: ShapeTarget, partition: int | None = None,
                  below: Position | None = None) -> int:
    """Drop tombstones (of ``partition``, or all) below ``below`` (or all).
    Tombstones guard against changes older than a delete arriving after it:
    replays (progress skips those anyway), backfill rows (which carry the
    backfill's start position) and keys moving between partitions. Drop them
    only below the start of any backfill that may still be running."""
    cond = [sql.SQL("TRUE")]
    params: list[Any] = []
    if partition is not None:
        cond.append(sql.SQL("_wb_partition = %s"))
        params.append(partition)
    if below is not None:
        cond.append(sql.SQL("(_wb_lsn, _wb_op_index) < (%s, %s)"))
        params.extend(below)
    with conn.transaction():
        return conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(
            tombstones_ident(target), sql.SQL(" AND ").join(cond)), params).rowcount


def _counts(cur: psycopg.Cursor, query: sql.Composable, params: Sequence = ()) -> Counter:
    """Run ``WITH x AS (<dml> RETURNING <partition>) SELECT partition, count(*)``."""
    wrapped = sql.SQL("WITH x(p) AS ({}) SELECT p, count(*) FROM x GROUP BY p").format(query)
    return Counter({p: n for p, n in cur.execute(wrapped, params).fetchall()})


def _content(target: ShapeTarget, a: str) -> sql.Composable:
    """A keyless row's whole content as text (``wire.ROW_COLUMN``'s form)."""
    return sql.SQL("ROW({})::text").format(sql.SQL(", ").join(
        sql.SQL("{}.{}").format(sql.Identifier(a), sql.Identifier(c)) for c in target.names))


def _rank_columns(a: str) -> sql.Composable:
    """:func:`_rank`'s three parts as columns (a :data:`multiset.Rank`)."""
    return sql.SQL("coalesce({a}._wb_lsn, -1), coalesce({a}._wb_op_index, -1), {a}._wb_snapshot_id IS NULL").format(
        a=sql.Identifier(a))


def _key_eq(target: ShapeTarget, a: str, b: str) -> sql.Composable:
    a_, b_ = sql.Identifier(a), sql.Identifier(b)
    return sql.SQL(" AND ").join(sql.SQL("{}.{} = {}.{}").format(a_, sql.Identifier(k), b_, sql.Identifier(k))
                                 for k in target.key_columns)


def _pos(a: str) -> sql.Composable:
    """The position of a target (or tombstone) row; none (NULL: written behind
    walbridge's back) is lower than every real position."""
    return sql.SQL("(coalesce({a}._wb_lsn, -1), coalesce({a}._wb_op_index, -1))").format(a=sql.Identifier(a))


def _rank(a: str, change: bool = False) -> sql.Composable:
    """A row's rank (``apply_plan``): its position, then whether it is a
    streamed change rather than a snapshot or backfill row (at equal
    positions the change is the newer). ``change``: ``a`` holds changes only
    (tombstones, pending removals), which have no snapshot id column."""
    streamed = sql.SQL("true") if change else sql.SQL("{}._wb_snapshot_id IS NULL").format(sql.Identifier(a))
    return sql.SQL("(coalesce({a}._wb_lsn, -1), coalesce({a}._wb_op_index, -1), {s})").format(
        a=sql.Identifier(a), s=streamed)


def _pos_lt(a: str, b: str, a_changes: bool = False) -> sql.Composable:
    """Target row (or, ``a_changes``, tombstone) ``a`` ranks below staged row ``b``."""
    return sql.SQL("{} < {}").format(_rank(a, a_changes), _rank(b))
