"""The driver apply: one micro-batch of several shapes (:func:`apply_shapes`,
what :class:`spark_consumer.query.BatchApplier` runs; :func:`apply_batch`:
of one), applied on one connection in one target transaction.

The path of one batch, top to bottom:
1. Lock the parts' progress rows, in a fixed order
   (:func:`spark_consumer.progress.lock_progress`); refuse a gap, and skip
   the rows progress already covers
   (:func:`spark_consumer.apply_plan.split_replayed`).
2. Per shape, plan the rest (:func:`spark_consumer.apply_plan.plan_batch`).
3. Ask every shape's target at once which plans only bring keys it has never
   seen (:func:`spark_consumer.statements.only_new_keys`: a few round trips
   for the batch, whatever its number of shapes).
4. Per shape, COPY such a plan straight into the table
   (:func:`spark_consumer.statements.insert_new_keys`), any other into the
   session's stage (:mod:`spark_consumer.staging`) and run the set-based
   statements (:func:`spark_consumer.statements.apply_stage`); record the
   backfill ends it applied.
5. Move each part's progress to its end
   (:func:`spark_consumer.batch.progress_update`,
   :func:`spark_consumer.progress.write_progress`); commit.

Invariants:
- One transaction per batch, the steps above: a crash anywhere leaves either
  all of it or none of it; a replayed micro-batch finds its offsets covered
  and is skipped part by part (rows below ``next_offset``).
- ``apply_batch`` commits, unless the connection is already inside a
  transaction: then it runs in a savepoint and the caller commits (or rolls back).
- Kafka offsets may be committed to the consumer group only after this commit
  (``BatchResult.offsets``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import psycopg

from spark_consumer.apply_plan import DEFAULT_GC_CONTROLS, plan_batch
from spark_consumer.batch import (
    BatchResult,
    Part,
    fill_results,
    merge_plan_stats,
    progress_update,
    staged_kinds,
    unapplied_rows,
)
from spark_consumer.progress import lock_progress, write_progress
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.staging import copy_rows, temp_stage
from spark_consumer.statements import apply_stage, insert_new_keys, only_new_keys, record_backfills, upsert_keys


def apply_batch(conn: psycopg.Connection, group: str, target: ShapeTarget, parts: Sequence[Part], *,
                on_gap: str = "raise", on_offset_reset: str = "raise",
                gc_controls: Iterable[str] = DEFAULT_GC_CONTROLS) -> BatchResult:
    """Apply one micro-batch of one shape (its parts: one per topic-partition)
    in one target transaction, progress included. ``on_gap``: ``"raise"``
    (default) or ``"ignore"`` when a part starts after the applied offsets;
    ``on_offset_reset``: see :func:`~spark_consumer.apply_plan.split_replayed`."""
    return apply_shapes(conn, group, [(target, parts)], on_gap=on_gap, on_offset_reset=on_offset_reset,
                        gc_controls=gc_controls)


def apply_shapes(conn: psycopg.Connection, group: str, batches: Sequence[tuple[ShapeTarget, Sequence[Part]]], *,
                 on_gap: str = "raise", on_offset_reset: str = "raise",
                 gc_controls: Iterable[str] = DEFAULT_GC_CONTROLS) -> BatchResult:
    """Apply several shapes' parts of one micro-batch in ONE transaction (the
    commit is one decision for the whole micro-batch)."""
    gc = frozenset(gc_controls)
    result = BatchResult()
    all_parts = [p for _, parts in batches for p in parts]
    if len({p.tp for p in all_parts}) != len(all_parts):
        raise ValueError("a (topic, partition) appears in more than one part of the batch")
    if not all_parts:
        return result
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT set_config('TimeZone', 'UTC', true)")
        progress, existed = lock_progress(conn, group, all_parts)
        planned = []
        for target, parts in batches:
            if not parts:
                continue
            todo_rows, floors = unapplied_rows(parts, progress, existed, result, on_gap=on_gap,
                                               on_offset_reset=on_offset_reset)
            plan = plan_batch(target, todo_rows, floors=floors, gc_controls=gc, fields=parts[0].fields,
                              keyless_pairs=False)
            merge_plan_stats(result, plan)
            result.controls.extend(plan.controls)
            planned.append((target, parts, plan, staged_kinds(plan), upsert_keys(plan)))
        new_keys = only_new_keys(conn, [(target, plan, staged, keys) for target, _, plan, staged, keys in planned])
        updates = []
        for (target, parts, plan, staged, keys), (types, holds_keys) in zip(planned, new_keys):
            if plan.stage_rows or plan.cuts or plan.scoped_cuts:
                if types is not None:
                    applied = insert_new_keys(conn, target, plan, staged, types)
                else:
                    stage, stage_types = temp_stage(conn, target)
                    if plan.stage_rows:
                        copy_rows(conn, target, stage, plan.stage_rows, types=stage_types)
                    applied = apply_stage(cur, target, stage, plan.cuts.values(), plan.keep_sets, staged,
                                          plan.scoped_cuts, keys, stage_types, holds_keys)
                fill_results(result.parts, parts[0].topic, staged, applied)
            if plan.backfill_ends:
                result.backfills_completed += record_backfills(cur, group, parts[0].topic, target,
                                                               plan.backfill_ends)
            for part in parts:
                st = plan.stats.get(part.tp)
                updates.append(progress_update(part, progress[part.tp], result.parts[part.tp],
                                               st.max_position if st else None, plan.cuts.get(part.partition)))
        write_progress(conn, group, updates)
    return result

