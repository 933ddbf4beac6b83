"""One micro-batch of a shape as the apply sees it
(:mod:`spark_consumer.apply_driver`): the parts that go in, one per
topic-partition, what happened to each, and where each part moves its
partition's progress. Pure: no database.

Invariants:
- A part covers the offsets ``[start, end)`` of one topic-partition, and its
  rows lie in that range (:func:`check_range`).
- After a batch a part's progress is: next offset = the part's end (never
  lower than before, unless its offsets were reset), applied position and
  floor = the higher of what progress held and what the batch applied
  (:func:`progress_update`).
- Kafka offsets may be committed to the consumer group only after the target
  transaction that moved progress commits (``BatchResult.offsets``); a crash
  between the two is harmless because the progress table, not the group,
  decides what is applied.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Iterable, Mapping, Sequence

from schemas import wire
from spark_consumer.apply_plan import (
    APPEND,
    DELETE,
    REMOVE,
    UPSERT,
    ApplyPlan,
    Cut,
    PlanStats,
    Position,
    field_getter,
    field_index,
    split_replayed,
)
from spark_consumer.progress import Progress, check_gap


@dataclass(frozen=True)
class Part:
    """One topic-partition's share of a micro-batch: the offset range
    ``[start, end)`` the batch covers and the decoded rows in it: mappings,
    or (the fast form) tuples whose items ``fields`` names (see
    :func:`spark_consumer.apply_plan.plan_batch`). ``topic_id``: the topic
    incarnation the offsets count in (the batch's, in Spark's checkpoint;
    None: not known)."""

    topic: str
    partition: int
    start: int
    end: int
    rows: Sequence = ()
    fields: tuple[str, ...] | None = None
    topic_id: str | None = None

    @property
    def tp(self) -> tuple[str, int]:
        return (self.topic, self.partition)


def parts_from_rows(rows: Iterable, ranges: Mapping[tuple[str, int], tuple[int, int]] | None = None,
                    fields: Sequence[str] | None = None, topic_ids: Mapping[str, str | None] | None = None
                    ) -> list[Part]:
    """Group rows (mappings, or tuples laid out by ``fields``) by (topic,
    partition). ``ranges`` gives each partition's ``[start, end)`` (the
    micro-batch's offsets, which may include partitions without rows); without
    it a part spans its rows' offsets. ``topic_ids``: each topic's incarnation
    (see :class:`Part`)."""
    fields = tuple(fields) if fields is not None else None
    if fields is None:
        def tp_of(r):
            return (r[wire.TOPIC_COLUMN], int(r[wire.PARTITION_COLUMN]))
    else:
        tp_of = itemgetter(field_index(fields, wire.TOPIC_COLUMN), field_index(fields, wire.PARTITION_COLUMN))
    offset_of = field_getter(fields, wire.OFFSET_COLUMN)
    grouped: dict[tuple[str, int], list] = defaultdict(list)
    for r in rows:
        grouped[tp_of(r)].append(r)
    parts = []
    for tp in sorted(set(grouped) | set(ranges or {})):
        rs = grouped.get(tp, [])
        if ranges and tp in ranges:
            start, end = ranges[tp]
        else:
            offsets = [int(offset_of(r)) for r in rs]
            start, end = min(offsets), max(offsets) + 1
        parts.append(Part(tp[0], int(tp[1]), int(start), int(end), rs, fields, (topic_ids or {}).get(tp[0])))
    return parts


def check_range(part: Part) -> None:
    """Refuse a part whose rows lie outside its offset range."""
    if not part.rows:
        return
    offsets = list(map(field_getter(part.fields, wire.OFFSET_COLUMN), part.rows))
    lo, hi = min(offsets), max(offsets)
    if lo < part.start or hi >= part.end:
        raise ValueError(f"{part.topic}[{part.partition}]: rows at offsets {lo}..{hi} are outside the part's "
                         f"range [{part.start}, {part.end})")


@dataclass
class PartResult:
    """What happened to one topic-partition's part of a batch."""

    topic: str
    partition: int
    start: int
    end: int
    rows: int = 0
    skipped_replayed: int = 0  # offsets progress already covered
    control: int = 0
    dlq: int = 0
    superseded: int = 0  # replaced in the batch by a newer change of the same key
    erased: int = 0  # below a cut (same batch) or the partition's floor (earlier batch)
    truncates: int = 0
    upserted: int = 0  # rows inserted or updated
    appended: int = 0  # keyless rows inserted
    cancelled: int = 0  # keyless appends a pending removal (an earlier batch's) took instead
    deleted: int = 0  # live rows removed by deletes (keyed) or removals (keyless)
    tombstoned: int = 0  # deletes recorded (keyed); removals left pending, their row not yet applied (keyless)
    stale: int = 0  # changes not applied: the target had the key at an equal or newer position
    truncated: int = 0  # rows removed by this partition's cuts (scoped ones included)
    tombstones_dropped: int = 0
    offset_reset: bool = False
    next_offset: int = 0  # progress after this batch

    @property
    def applied(self) -> int:
        return self.upserted + self.appended + self.cancelled + self.deleted + self.tombstoned + self.truncated


@dataclass(frozen=True)
class BackfillGC:
    """A backfill this batch completed (its ``backfill_end`` applied on every
    partition) and what its final GC removed."""

    topic: str
    backfill_id: str
    shape: str
    gc_deleted: int  # target rows in scope below the backfill's start or without a position
    gc_tombstones: int


@dataclass
class BatchResult:
    parts: dict[tuple[str, int], PartResult] = field(default_factory=dict)
    controls: list[Mapping] = field(default_factory=list)
    backfills_completed: list[BackfillGC] = field(default_factory=list)

    @property
    def offsets(self) -> dict[tuple[str, int], int]:
        """Next offset per (topic, partition): what to commit to the consumer
        group once the target transaction has committed."""
        return {tp: r.next_offset for tp, r in self.parts.items()}

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.parts.values())


# The PartResult counts that planning decides.
PLAN_COUNTS = ("control", "dlq", "superseded", "erased", "truncates")


def plan_counts(st: PlanStats | None) -> dict[str, int]:
    """What planning did with a part's rows, as its :class:`PartResult`
    counts it (zeros for a part the plan has no statistics of)."""
    if st is None:
        return dict.fromkeys(PLAN_COUNTS, 0)
    return {"control": st.control, "dlq": st.dlq, "superseded": st.superseded,
            "erased": st.erased + st.below_floor, "truncates": st.truncates}


def add_counts(res: PartResult, counts: Mapping[str, int]) -> None:
    for name, n in counts.items():
        setattr(res, name, getattr(res, name) + n)


def merge_plan_stats(result: BatchResult, plan: ApplyPlan) -> None:
    for tp, st in plan.stats.items():
        res = result.parts.get(tp)
        if res is None:
            raise ValueError(f"rows of {tp[0]}[{tp[1]}] are not in any part of the batch")
        add_counts(res, plan_counts(st))


def staged_kinds(plan: ApplyPlan) -> dict[int, Counter]:
    """Per partition, the plan's staged rows by kind."""
    n = len(plan.target.columns)
    counts = Counter(map(itemgetter(n + 4, n), plan.stage_rows))  # (partition, kind)
    out: dict[int, Counter] = defaultdict(Counter)
    for (p, kind), c in counts.items():
        out[p][kind] = c
    return out


def fill_results(results: dict[tuple[str, int], PartResult], topic: str, staged: Mapping[int, Counter],
                 applied: Mapping[str, Counter]) -> None:
    """Add what the statements did (``applied``: per outcome, counts per
    partition) to the topic's part results; staged changes that did not land
    count as stale."""
    for (t, p), res in results.items():
        if t != topic:
            continue
        for name in ("upserted", "appended", "cancelled", "deleted", "tombstoned", "truncated",
                     "tombstones_dropped"):
            setattr(res, name, getattr(res, name) + applied.get(name, Counter()).get(p, 0))
        kinds = staged.get(p, Counter())
        if "upserted" in applied:  # keyed
            res.stale += (kinds[UPSERT] - applied["upserted"].get(p, 0)) + (
                kinds[DELETE] - applied["tombstoned"].get(p, 0))
        else:
            res.stale += (kinds[APPEND] - applied["appended"].get(p, 0) - applied["cancelled"].get(p, 0)) + (
                kinds[REMOVE] - applied["deleted"].get(p, 0) - applied["tombstoned"].get(p, 0))


def unapplied_rows(parts: Sequence[Part], progress: Mapping[tuple[str, int], Progress], existed: Iterable,
                   result: BatchResult, *, on_gap: str, on_offset_reset: str) -> tuple[list, dict[int, Position]]:
    """The rows of one shape's parts that progress does not cover yet (each
    part's :class:`PartResult` made in ``result``), and each partition's
    floor. A part that starts after its partition's progress raises
    (:func:`~spark_consumer.progress.check_gap`) unless its progress is new
    (not in ``existed``)."""
    rows: list = []
    floors: dict[int, Position] = {}
    fields = parts[0].fields if parts else None
    if any(part.fields != fields for part in parts):
        raise ValueError(f"the parts of {parts[0].topic} lay their rows out differently")
    for part in parts:
        res = result.parts[part.tp] = PartResult(part.topic, part.partition, part.start, part.end, rows=len(part.rows))
        prog = progress[part.tp]
        if part.tp in existed:
            check_gap(part, prog, on_gap)
        check_range(part)
        if prog.next_offset <= part.start:  # the usual case: nothing of this part was applied
            rows.extend(part.rows)
        else:
            todo, skipped, reset = split_replayed(part.rows, prog, where=f"{part.topic}[{part.partition}]",
                                                  on_offset_reset=on_offset_reset, fields=fields)
            res.skipped_replayed, res.offset_reset = skipped, reset
            rows.extend(todo)
        if prog.floor is not None:
            floors[part.partition] = prog.floor
    return rows, floors


def progress_update(part: Part, prog: Progress, res: PartResult, max_position: Position | None,
                    cut: Cut | None) -> tuple:
    """The part's progress after the batch, as
    :func:`spark_consumer.progress.write_progress` takes it: (topic,
    partition, next_offset, applied, floor, topic_id). Sets
    ``res.next_offset``. ``prog``: as the part's incarnation sees it
    (:meth:`~spark_consumer.progress.Progress.for_incarnation`)."""
    applied = _pmax(prog.applied, max_position)
    floor = _pmax(prog.floor, cut.position if cut is not None else None)
    nxt = part.end if res.offset_reset else max(prog.next_offset, part.end)
    res.next_offset = nxt
    return (part.topic, part.partition, nxt, applied, floor, part.topic_id or prog.topic_id)


def _pmax(a: Position | None, b: Position | None) -> Position | None:
    if a is None:
        return tuple(b) if b is not None else None
    if b is None:
        return tuple(a)
    return max(tuple(a), tuple(b))
