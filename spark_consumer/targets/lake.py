"""What every lakehouse target shares (:class:`LakeTarget`): a table per
shape, applied by Spark SQL ``MERGE`` on the driver's session, the shape's
progress in the commit of its rows. A format (:mod:`~spark_consumer.targets.delta`,
:mod:`~spark_consumer.targets.iceberg`) says only where its tables are, how
it makes one, how a commit carries a record and how its history is read,
how it rolls a table back and keeps it up.

The path of one keyed shape's batch, top to bottom:
1. Refuse a gap, skip what progress covers, plan the rest
   (:func:`spark_consumer.apply_plan.plan_batch`), as the PostgreSQL target.
2. The plan's deletes (and cuts) into the shape's tombstones (per deleted
   key, the position, partition and offset of its delete), by one MERGE
   that only moves a key's tombstone forward and drops it when a newer
   upsert lands. Skipped, with step 3's anti-join, while the shape has no
   tombstone: an insert-and-update stream pays for no delete.
3. One MERGE into the shape's table: an upsert lands where the row ranks
   below it and no tombstone ranks at or above it, a delete removes an older
   row, a cut removes its partition's rows below it; the commit carries the
   shape's new progress (:class:`spark_consumer.lake_progress.LakeProgress`).

A keyless shape's batch (a multiset of rows, the PostgreSQL target's rules,
:mod:`spark_consumer.multiset`): which batch appends the kept removals take
and which row (of the table, or an append of the batch) each removal takes
are read first (:func:`~spark_consumer.targets.merge_sql.equal_rows`, paired
on the driver); then one MERGE into the shape's tombstones table, which keeps
every removal with the rank of what it took, and one MERGE into the table
that appends (a streamed append once per position) and deletes the taken
rows by their bookkeeping.

Shapes side by side: a micro-batch's shapes are applied by up to
:data:`SHAPES_AT_ONCE` threads, each with a Spark session of its own (a
commit's record rides in a session setting, the stage in a session's temp
view). A ``MERGE`` of a few rows costs seconds of driver work and small
Spark jobs, so one shape's waits overlap another's work. A shape's table and
record are its own, so shapes commit independently, as they did one after
the other; the batch returns (and its offsets may be committed) only when
every shape has. A single shape is applied on the calling thread.

Upkeep: every ``compact_interval`` seconds each followed table written
since its last compaction is compacted (the first time after a start, every
table: an earlier run may have written it); every ``vacuum_interval``
seconds what no version of the last ``retain_hours`` needs is removed. Both
run on the calling thread once every shape of a batch has returned: the
consumer is the tables' only writer, so upkeep never conflicts with a
MERGE, and the stream goes on.

Invariants:
- Every MERGE into a shape's table commits, even one that changes no row,
  and its commit carries the record; so does a compaction's, so the newest
  commit of the table always has it.
- The table and its progress move in one commit: a crash before it leaves
  neither (step 2 is idempotent: a replay plans the same tombstones), after
  it both; a replayed range is skipped by progress.
- A keyless shape's kept removals are not idempotent (taking an append
  moves what one took), so their commit carries the record the table's
  commit will carry, and a start rolls them back to before any commit that
  is ahead of the table's record (a crash between the two).
- A scoped backfill (some key buckets) never collects anything here: its
  rows are applied as changes and the rest of the table is kept (which
  rows a bucket holds only PostgreSQL can say); on a keyless shape, where
  that would keep two copies of a re-read row, it holds the shape.
- What a target does not follow yet stops the shape loudly
  (:class:`~spark_consumer.target_layout.ShapeCannotFollow`), never a row
  applied wrong: a scoped backfill of a keyless shape, a writer schema that retypes a key
  column other than by widening it
  (:func:`~spark_consumer.targets.merge_sql.follow_changes`; renames, drops,
  retypes, added columns and a changed key are followed), a special value
  (``infinity``) Spark's type cannot hold, a keyless removal that would take
  a row another writer added (it has no position to delete it by).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.types import StructField

from schemas import wire
from spark_consumer.apply_plan import (
    APPEND,
    DEFAULT_GC_CONTROLS,
    DELETE,
    REMOVE,
    UPSERT,
    ApplyPlan,
    Cut,
    plan_batch,
)
from spark_consumer.batch import (
    BatchResult,
    fill_results,
    merge_plan_stats,
    progress_update,
    staged_kinds,
    unapplied_rows,
)
from spark_consumer.lake_progress import LakeProgress, backfill_ends_applied
from spark_consumer.multiset import Candidate, Taker, pair
from spark_consumer.progress import Progress
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.target_layout import ShapeCannotFollow
from spark_consumer.targets.base import ShapeBatch
from spark_consumer.targets.merge_sql import (
    BOOKKEEPING,
    MOVE,
    TAKE,
    TOMBSTONE_BOOKKEEPING,
    TOOK,
    Cuts,
    ddl_columns,
    equal_rows,
    follow_changes,
    kept_columns,
    keyless_table_merge,
    literal,
    marked_rows,
    pending_merge,
    quote,
    shape_fields,
    stage_table,
    table_merge,
    tombstones_merge,
)

log = logging.getLogger("walbridge.consumer")

KEY_PROPERTY = "walbridge.key"  # table property: the shape's key columns (a JSON list) when the table was made
HISTORY_LOOKBACK = 100  # commits read back for the progress before the whole history
STAGE_VIEW, PENDING_VIEW = "walbridge_stage", "walbridge_pending"
SHAPES_AT_ONCE = 4  # shapes of a micro-batch applied side by side


@dataclass(frozen=True)
class Upkeep:
    """When the target compacts and vacuums its tables (seconds; 0: never),
    and how many hours of versions a vacuum keeps (``[consumer]
    compact_interval``, ``vacuum_interval``, ``vacuum_retain_hours``)."""

    compact_interval: float = 600.0
    vacuum_interval: float = 86400.0
    retain_hours: float = 168.0


class LakeTarget:
    """See the module docstring. A format implements the methods that raise
    ``NotImplementedError``; ``upkeep``: when the tables are compacted and
    vacuumed."""

    format_name = "lake"  # for messages: "Delta", "Iceberg"

    def __init__(self, spark: SparkSession, address: str, on_dropped_column: str = "keep",
                 upkeep: Upkeep = Upkeep(), clock: Callable[[], float] = time.monotonic):
        # Sessions of its own: the commit metadata a session sets is seen by its statements only.
        self._main = spark.newSession()
        self._settings: dict[str, str] = {}  # what every session of the target has (set_conf)
        self._sessions: list[SparkSession] = []  # the apply threads' sessions
        self._local = threading.local()  # .spark: the calling apply thread's session
        self._pool: ThreadPoolExecutor | None = None
        self.address = address
        self.on_dropped_column = on_dropped_column
        self.upkeep, self.clock = upkeep, clock
        self._followed: dict[str, ShapeTarget] = {}  # topic -> what its table has
        self._records: dict[str, LakeProgress] = {}  # topic -> its table's record, as committed
        # Tombstone tables that may hold a row (had files at follow, or took a
        # delete since): only they are merged into and anti-joined against.
        self._has_tombstones: set[str] = set()
        # Tables a compaction may find small files in: written since their last one.
        self._unkempt: set[str] = set()
        self._rekeyed: dict[str, bool] = {}  # tables whose key changed, until their tombstones are made anew
        self._scoped_seen: set[str] = set()  # scoped backfills already logged
        self._group: str | None = None  # the consumer group whose progress the tables carry
        start = clock()
        self._due = {"compact": start + upkeep.compact_interval, "vacuum": start + upkeep.vacuum_interval}

    # -- what a format implements
    def table_ref(self, target: ShapeTarget) -> str:
        """The Spark SQL reference of the shape's table."""
        raise NotImplementedError

    def tombstones_ref(self, target: ShapeTarget) -> str:
        """The Spark SQL reference of the shape's tombstones (keyless: pending removals)."""
        raise NotImplementedError

    def _columns(self, ref: str) -> list[StructField] | None:
        """The table's columns; None when there is no table."""
        raise NotImplementedError

    def _create(self, ref: str, fields: Sequence[StructField], properties: dict[str, str]) -> None:
        raise NotImplementedError

    def _history(self, ref: str, limit: int | None) -> list[tuple[int, str | None]]:
        """The table's commits that make its current state, newest first:
        (version or snapshot id, the record text it carries or None)."""
        raise NotImplementedError

    def _carrying(self, metadata: str | None) -> Iterator[None]:
        """A context in which the session's commits carry ``metadata``."""
        raise NotImplementedError

    def _has_rows(self, ref: str) -> bool:
        raise NotImplementedError

    def _roll_back(self, ref: str, version: int) -> None:
        """Undo the commit ``version`` and every later one."""
        raise NotImplementedError

    def _keep_up_table(self, ref: str, command: str, record: str | None) -> None:
        """Run ``command`` ("compact" or "vacuum") on one table, whose
        commits carry ``record`` (the shape's newest, as JSON)."""
        raise NotImplementedError

    # -- shared
    @property
    def spark(self) -> SparkSession:
        """The session of the calling thread: its own in an apply thread, else the target's."""
        return getattr(self._local, "spark", None) or self._main

    def set_conf(self, key: str, value: str) -> None:
        """Set ``key`` in every session the target applies in."""
        self._settings[key] = value
        for session in (self._main, *self._sessions):
            session.conf.set(key, value)

    def _thread_session(self) -> None:
        """Give the calling apply thread a session of its own."""
        session = self._main.newSession()
        for key, value in self._settings.items():
            session.conf.set(key, value)
        self._sessions.append(session)
        self._local.spark = session

    def follow(self, topic: str, target: ShapeTarget) -> None:
        """Create the shape's table and tombstones, or make them follow a new
        writer schema (:func:`~spark_consumer.targets.merge_sql.follow_changes`);
        what this target cannot follow stops the shape."""
        wanted = shape_fields(target)
        table = self.table_ref(target)
        have = self._columns(table)
        if have is None:
            self._create(table, wanted + list(BOOKKEEPING), {KEY_PROPERTY: json.dumps(list(target.key_columns))})
        else:
            key = self.spark.sql(f"SHOW TBLPROPERTIES {table} ({literal(KEY_PROPERTY)})").collect()
            had_key = tuple(json.loads(key[0].value)) if key and key[0].value.startswith("[") else None
            self._follow_columns(target, table, have, wanted, had_key)
        tomb = self.tombstones_ref(target)
        # Keyed: the key of each deleted row. Keyless: each removal's row, and what it took.
        held = [f for f in wanted if target.keyless or f.name in target.key_columns]
        held += list(TOOK) if target.keyless else []
        have_tomb = self._columns(tomb)
        if have_tomb is not None and self._rekeyed.pop(table, False):
            # Made anew for the new key (as on PostgreSQL): the producer re-reads the shape.
            self._replace_empty(tomb, held + list(TOMBSTONE_BOOKKEEPING))
            self._has_tombstones.discard(tomb)
            self.spark.sql(f"ALTER TABLE {table} SET TBLPROPERTIES ({literal(KEY_PROPERTY)} = "
                           f"{literal(json.dumps(list(target.key_columns)))})")
        elif have_tomb is None:
            self._create(tomb, held + list(TOMBSTONE_BOOKKEEPING), {})
        else:
            self._follow_columns(target, tomb, have_tomb, held)
            if self._has_rows(tomb):
                self._has_tombstones.add(tomb)
        self._unkempt.add(table)
        if tomb in self._has_tombstones:
            self._unkempt.add(tomb)
        self._followed[topic] = target

    def _follow_columns(self, target: ShapeTarget, ref: str, have: list[StructField], wanted: list[StructField],
                        had_key: tuple[str, ...] | None = None) -> None:
        steps = follow_changes(target, have, wanted, had_key, self.on_dropped_column)
        if steps.problems:
            raise ShapeCannotFollow(f"shape {target.shape}: the {self.format_name} table cannot follow its writer "
                                    "schema yet: " + "; ".join(steps.problems))
        if not steps:
            return
        if steps.renamed or steps.dropped:
            self._allow_renames(ref)
        for old, new in steps.renamed:
            self.spark.sql(f"ALTER TABLE {ref} RENAME COLUMN {quote(old)} TO {quote(new)}")
        if steps.dropped:
            self.spark.sql(f"ALTER TABLE {ref} DROP COLUMNS ({', '.join(quote(c) for c in steps.dropped)})")
        if steps.widened or steps.retyped:
            self._retype(target, ref, steps.widened, steps.retyped)
        if steps.added:
            self.spark.sql(f"ALTER TABLE {ref} ADD COLUMNS ({ddl_columns(steps.added)})")
        if steps.rekeyed:  # follow() makes the tombstones anew, then records the key
            self._rekeyed[ref] = True
            log.warning("shape %s: the key of %s table %s changed from (%s) to (%s): %s", target.shape,
                        self.format_name, ref, ", ".join(had_key or ()), ", ".join(target.key_columns),
                        "it follows the rules of keyless shapes" if target.keyless else "its tombstones are made anew")
        elif had_key is not None and had_key != target.key_columns:  # a key column renamed
            self.spark.sql(f"ALTER TABLE {ref} SET TBLPROPERTIES ({literal(KEY_PROPERTY)} = "
                           f"{literal(json.dumps(list(target.key_columns)))})")
        log.info("shape %s: %s table %s follows its writer schema: %s", target.shape, self.format_name, ref,
                 "; ".join(filter(None, (
                     ", ".join(f"{o} renamed to {n}" for o, n in steps.renamed),
                     ", ".join(f"{c} dropped" for c in steps.dropped),
                     ", ".join(f"{f.name} retyped to {f.dataType.simpleString()}"
                               for f in steps.widened + steps.retyped),
                     ", ".join(f"{f.name} added" for f in steps.added)))))

    def _replace_empty(self, ref: str, fields: Sequence[StructField]) -> None:
        """Make the table ``ref`` anew, empty, with columns ``fields``."""
        raise NotImplementedError

    def _allow_renames(self, ref: str) -> None:
        """Let the table's columns be renamed and dropped (a format whose
        tables need a feature for it turns it on)."""

    def _retype(self, target: ShapeTarget, ref: str, widened: Sequence[StructField],
                retyped: Sequence[StructField]) -> None:
        """Give columns their new types: ``widened`` keeping every value
        (in place), ``retyped`` where the format can (this one cannot)."""
        if retyped:
            raise ShapeCannotFollow(f"shape {target.shape}: the {self.format_name} table cannot retype "
                                    + ", ".join(f"column {f.name!r} to {f.dataType.simpleString()}" for f in retyped)
                                    + " in place")
        for f in widened:
            self.spark.sql(f"ALTER TABLE {ref} ALTER COLUMN {quote(f.name)} TYPE {f.dataType.simpleString()}")

    def read_progress(self, group: str) -> dict[tuple[str, int], Progress]:
        """Each followed shape's progress: the newest commit of its table that
        carries the group's."""
        out: dict[tuple[str, int], Progress] = {}
        self._group = group
        for topic, target in self._followed.items():
            record = self.newest_record(self.table_ref(target), group)
            if record is not None and record.topic != topic:
                log.warning("shape %s: the %s table's progress is for topic %s, not %s; read from the start",
                            target.shape, self.format_name, record.topic, topic)
                record = None
            self._records[topic] = record or LakeProgress(topic)
            if target.keyless:
                self._roll_back_pending(target, group, self._records[topic].commits)
            out.update({(topic, p): pr for p, pr in self._records[topic].partitions.items()})
        return out

    def newest_record(self, ref: str, group: str) -> LakeProgress | None:
        for limit in (HISTORY_LOOKBACK, None):
            commits = self._history(ref, limit)
            for _, text in commits:
                record = LakeProgress.from_json(text, group)
                if record is not None:
                    return record
            if len(commits) < HISTORY_LOOKBACK:
                return None
        return None

    def _roll_back_pending(self, target: ShapeTarget, group: str, commits: int) -> None:
        """Undo pending-removal commits ahead of the table's record (a crash
        between a batch's two commits): the batch is applied again, whole."""
        pending = self.tombstones_ref(target)
        ahead = [version for version, text in self._history(pending, None)
                 if (r := LakeProgress.from_json(text, group)) is not None and r.commits > commits]
        if ahead:
            log.warning("shape %s: its pending removals are ahead of the table (a crash between a batch's "
                        "commits); rolling them back to before commit %d", target.shape, ahead[-1])
            self._roll_back(pending, ahead[-1])
            self._has_tombstones.add(pending)

    def apply(self, group: str, batches: Sequence[ShapeBatch], *, on_offset_reset: str,
              hold: Callable[[str, str], None]) -> BatchResult:
        """Apply each shape's batch, up to :data:`SHAPES_AT_ONCE` side by side
        (module docstring); when all have returned, hold the shapes that
        cannot follow and raise the first error of another kind."""
        def one(b: ShapeBatch) -> tuple[BatchResult, str | None]:
            res = BatchResult()
            try:
                if b.follow:
                    self.follow(b.topic, b.target)
                self._apply_shape(group, b, res, on_offset_reset)
            except ShapeCannotFollow as e:
                return res, str(e)
            return res, None

        if len(batches) <= 1:
            outcomes = [one(b) for b in batches]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(SHAPES_AT_ONCE, "walbridge-lake", self._thread_session)
            futures = [self._pool.submit(one, b) for b in batches]
            wait(futures)  # none still running when an error goes up
            outcomes = [f.result() for f in futures]
        result = BatchResult()
        for b, (res, held) in zip(batches, outcomes):
            if held is not None:  # its rows left out, its progress as it was
                hold(b.topic, held)
                continue
            result.parts.update(res.parts)
            result.controls.extend(res.controls)
            result.backfills_completed.extend(res.backfills_completed)
        self._keep_up()
        return result

    def _keep_up(self) -> None:
        """Compact the tables written since their last compaction, or vacuum
        every followed table, when due (module docstring)."""
        intervals = {"compact": self.upkeep.compact_interval, "vacuum": self.upkeep.vacuum_interval}
        for command, interval in intervals.items():
            if not interval or self.clock() < self._due[command]:
                continue
            started, done = time.monotonic(), 0
            for topic, target in self._followed.items():
                refs = [ref for ref in (self.table_ref(target), self.tombstones_ref(target))
                        if command == "vacuum" or ref in self._unkempt]
                if not refs:
                    continue
                record = self._records.get(topic)
                carried = record.to_json(self._group) if record and self._group else None
                with self._carrying(carried):
                    for ref in refs:
                        self._keep_up_table(ref, command, carried)
                done += len(refs)
                if command == "compact":
                    self._unkempt.difference_update(refs)
            log.info("%s: %s of %d tables took %.1fs", self.format_name, command, done, time.monotonic() - started)
            self._due[command] = self.clock() + interval

    def _apply_shape(self, group: str, b: ShapeBatch, result: BatchResult, on_offset_reset: str) -> None:
        target, parts = b.target, b.parts
        record = self._records.setdefault(b.topic, LakeProgress(b.topic))
        committed = record.partitions
        progress = {part.tp: committed[part.partition].for_incarnation(part.topic_id)
                    if part.partition in committed else Progress(part.start) for part in parts}
        existed = {part.tp for part in parts if part.partition in committed}
        todo_rows, floors = unapplied_rows(parts, progress, existed, result, on_gap="raise",
                                           on_offset_reset=on_offset_reset)
        plan = plan_batch(target, todo_rows, floors=floors, gc_controls=DEFAULT_GC_CONTROLS, fields=parts[0].fields,
                          keyless_pairs=False)
        if plan.scoped_cuts:
            self._skip_scoped_collection(target, plan.scoped_cuts)
        merge_plan_stats(result, plan)
        result.controls.extend(plan.controls)
        backfills, collected = backfill_ends_applied(record.backfills, [c for c in plan.backfill_ends if not c.scope])
        cuts = {p: c.position for p, c in plan.cuts.items()}
        staged = staged_kinds(plan)
        updates = {}
        for part in parts:
            st = plan.stats.get(part.tp)
            _, p, nxt, applied, floor, topic_id = progress_update(part, progress[part.tp], result.parts[part.tp],
                                                                  st.max_position if st else None,
                                                                  plan.cuts.get(part.partition))
            updates[p] = Progress(nxt, applied, floor, topic_id)
        new_record = LakeProgress(b.topic, {**committed, **updates}, backfills, record.commits + 1)
        if target.keyless:
            applied_counts = self._merge_keyless(target, plan, cuts, collected, new_record.to_json(group))
        else:
            self._merge(target, plan, cuts, collected, new_record.to_json(group),
                        deletes=any(c[DELETE] for c in staged.values()))
            applied_counts = {"upserted": Counter({p: c[UPSERT] for p, c in staged.items()}),
                              "tombstoned": Counter({p: c[DELETE] for p, c in staged.items()})}
        fill_results(result.parts, b.topic, staged, applied_counts)
        self._records[b.topic] = new_record

    def _skip_scoped_collection(self, target: ShapeTarget, cuts: Sequence[Cut]) -> None:
        """A backfill of some key buckets (another consumer group's
        ``reconcile`` against a PostgreSQL target: a lake's is unscoped) is
        applied as changes; what it did not re-read is kept, because which
        rows its buckets hold only PostgreSQL can say. Re-read rows converge by
        key, so a keyed table loses nothing; a keyless one would keep both
        copies of every re-read row, so it is held."""
        ids = sorted({str((c.info or {}).get("backfill_id")) for c in cuts})
        if target.keyless:
            raise ShapeCannotFollow(f"shape {target.shape}: backfill {', '.join(ids)} of some key buckets reached "
                                    f"the {self.format_name} target, which cannot collect a keyless shape's old "
                                    "copies by bucket; backfill the whole shape (walbridge reconcile against this "
                                    "target does)")
        if not set(ids) <= self._scoped_seen:  # once per backfill, not per batch
            self._scoped_seen.update(ids)
            log.warning("shape %s: backfill %s re-reads some key buckets (another consumer group's reconcile): "
                        "its rows are applied to the %s table; rows of those buckets it did not re-read are kept "
                        "(walbridge reconcile against this target backfills the whole shape)", target.shape,
                        ", ".join(ids), self.format_name)

    def _merge(self, target: ShapeTarget, plan: ApplyPlan, cuts: Cuts, collected: Sequence[int], metadata: str,
               deletes: bool) -> None:
        """Steps 2 and 3 of the module docstring; ``deletes``: the plan has some."""
        keep = kept_columns(plan)
        tomb = self.tombstones_ref(target)
        if deletes:
            self._has_tombstones.add(tomb)
        tombstones = tomb if tomb in self._has_tombstones else None
        # Without tombstones the table's MERGE is the one statement: its stage
        # goes lean (each column is width the JVM copies and joins).
        stage = stage_table(target, plan, lean=tombstones is None)
        self.spark.createDataFrame(stage).createOrReplaceTempView(STAGE_VIEW)
        if tombstones is not None:
            self.spark.sql(tombstones_merge(target, tomb, STAGE_VIEW, cuts, collected)).collect()
            self._unkempt.add(tomb)
        table = self.table_ref(target)
        with self._carrying(metadata):
            self.spark.sql(table_merge(target, table, tombstones, STAGE_VIEW, keep, cuts, collected,
                                       stage.column_names)).collect()
        if plan.stage_rows or cuts or collected:
            self._unkempt.add(table)

    def _merge_keyless(self, target: ShapeTarget, plan: ApplyPlan, cuts: Cuts, collected: Sequence[int],
                       metadata: str) -> dict[str, Counter]:
        """A keyless batch (module docstring): who takes what, read first; then
        the kept removals' commit and the table's, both with the record.
        Counts per outcome and partition."""
        stage = stage_table(target, plan)
        stage = stage.append_column(wire.SEQ_COLUMN, pa.array(range(stage.num_rows), pa.int64()))
        self.spark.createDataFrame(stage).createOrReplaceTempView(STAGE_VIEW)
        table, pending = self.table_ref(target), self.tombstones_ref(target)
        kinds = stage.column(wire.KIND_COLUMN).to_pylist()
        at = [wire.SEQ_COLUMN, wire.PARTITION_COLUMN, wire.OFFSET_COLUMN]

        def rows(query: str) -> list[tuple]:
            return [tuple(r) for r in self.spark.sql(query).collect()]

        takes_kept = APPEND in kinds and pending in self._has_tombstones
        # Every stage row's content, read once (what pairing compares): (content, rank, kind, seq, partition, offset).
        staged = rows(equal_rows(target, STAGE_VIEW, None, None, None, [wire.KIND_COLUMN, *at])
                      ) if takes_kept or REMOVE in kinds else []
        appends = [Candidate(i, c, (lsn, opi, st), (p, off), not st)
                   for c, lsn, opi, st, k, i, p, off in staged if k == APPEND]
        # Kept removals take the batch's appends: their row, late, or a re-read copy of what they took.
        moved: dict[int, tuple] = {}  # an append's stage index -> (the removal's position, the append's rank)
        if takes_kept:
            kept = [Taker((lsn, opi), c, (lsn, opi, True), None if tl is None else (tl, to, ts))
                    for c, lsn, opi, _, tl, to, ts in rows(equal_rows(
                        target, pending, None, STAGE_VIEW, APPEND, [f.name for f in TOOK], changes_only=True))]
            moved = {c.id: (k, c.rank) for k, c in pair(kept, appends).items()}
        # The batch's removals take the newest equal row older than each: the table's, or an append of the batch.
        took: dict[int, Candidate] = {}  # a removal's stage index -> what it took
        if REMOVE in kinds:
            removals = [Taker(i, c, (lsn, opi, True)) for c, lsn, opi, _, k, i, _, _ in staged if k == REMOVE]
            marks = [f.name for f in BOOKKEEPING]
            candidates = [Candidate(("table", tuple(m)), c, (lsn, opi, st), (m[2], m[3]), not st)
                          for c, lsn, opi, st, *m in rows(equal_rows(target, table, None, STAGE_VIEW, REMOVE, marks))]
            took = pair(removals, candidates + [a for a in appends if a.id not in moved])
        if any(isinstance(c.id, tuple) and c.id[1][0] is None for c in took.values()):
            raise ShapeCannotFollow(f"shape {target.shape}: a removed row equals a row of the {self.format_name} "
                                    "table that has no position (another writer added it): it cannot be told "
                                    "apart; reconcile the shape")
        taken_here = {c.id for c in took.values() if not isinstance(c.id, tuple)}
        parts = stage.column(wire.PARTITION_COLUMN).to_pylist()
        out = {name: Counter() for name in ("appended", "cancelled", "deleted", "tombstoned")}
        for i, (kind, p) in enumerate(zip(kinds, parts)):
            if kind == APPEND:
                out["cancelled" if i in moved or i in taken_here else "appended"][p] += 1
            else:
                out["deleted" if i in took else "tombstoned"][p] += 1
        ranks = [took[i].rank if i in took else (None, None, None) for i in range(stage.num_rows)]
        kept_stage = stage
        for f, values in zip(TOOK, zip(*ranks) if ranks else ((), (), ())):
            kept_stage = kept_stage.append_column(f.name, pa.array(values, to_arrow_type(f.dataType)))
        pending_source = pa.concat_tables([
            kept_stage.filter(pa.array([k == REMOVE for k in kinds], pa.bool_())),
            marked_rows(kept_stage.schema, MOVE, [(*k, *r) for k, r in moved.values()],
                        [wire.LSN_COLUMN, wire.OP_INDEX_COLUMN, *(f.name for f in TOOK)])])
        lands = pa.array([k == APPEND and i not in moved and i not in taken_here for i, k in enumerate(kinds)],
                         pa.bool_())
        table_source = pa.concat_tables([stage.filter(lands), marked_rows(
            stage.schema, TAKE, [c.id[1] for c in took.values() if isinstance(c.id, tuple)],
            [f.name for f in BOOKKEEPING])])
        with self._carrying(metadata):
            if pending_source.num_rows or ((cuts or collected) and pending in self._has_tombstones):
                self._has_tombstones.add(pending)
                self.spark.createDataFrame(pending_source).createOrReplaceTempView(PENDING_VIEW)
                self.spark.sql(pending_merge(target, pending, PENDING_VIEW, cuts, collected)).collect()
                self._unkempt.add(pending)
            self.spark.createDataFrame(table_source).createOrReplaceTempView(STAGE_VIEW)
            self.spark.sql(keyless_table_merge(target, table, STAGE_VIEW, cuts, collected)).collect()
        if table_source.num_rows or cuts or collected:
            self._unkempt.add(table)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


@contextmanager
def session_setting(spark: SparkSession, key: str, value: str | None) -> Iterator[None]:
    """``key`` set to ``value`` in the session for the block (None: left unset)."""
    if value is None:
        yield
        return
    spark.conf.set(key, value)
    try:
        yield
    finally:
        spark.conf.unset(key)
