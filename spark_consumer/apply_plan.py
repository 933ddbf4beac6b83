"""Apply planning: one micro-batch of decoded change rows of one shape → what
must happen to the shape's target table. Pure: no database, no Spark; the I/O
shell is :mod:`spark_consumer.apply_driver`.

Input: the rows :mod:`spark_consumer.decode` produces (one per Kafka message;
the shape's row columns by PostgreSQL name plus the ``_wb_*`` bookkeeping
columns), for one shape, from any number of partitions, in any order. A row is
a mapping, or a tuple laid out by a ``fields`` list naming its items (decode's
column order, as the job gets them from Arrow column by column: the fast form,
planned without copying; the result is the same).

Invariants:
- A change's *position* is ``(_wb_lsn, _wb_op_index)``, compared
  lexicographically. A snapshot's rows share its position ``(S, 0)``, and a
  transaction whose commit record begins exactly at the snapshot's
  consistent point S is streamed (it is not in the snapshot) with the same
  position: at equal positions a streamed change outranks a snapshot or
  backfill row (the *rank* is ``(position, no _wb_snapshot_id)``); further
  ties are broken by ``(_wb_partition, _wb_offset)``, so planning is
  deterministic. Cuts compare positions only: a cut at a snapshot's position
  erases neither its rows nor the changes at that position.
- Keyed shapes: per key only the change with the highest position survives
  (``upsert`` for ``c``/``u``/``r``, ``delete`` for ``d``), whatever the order
  the rows came in. The plan has at most one row per key; the shell applies it
  only where the target's (or the key's tombstone's) position is lower, so an
  older, replayed or out-of-order change never overwrites a newer one and a
  deleted key never comes back to life.
- Unchanged TOAST values (``_wb_unchanged``) are never written as NULL: the
  value comes from the latest earlier change of the same key in the batch that
  carried it (not across a delete or a cut); otherwise the column is listed in
  the planned row's ``keep`` and the shell keeps the target's current value.
- Special values (``_wb_special``: PostgreSQL text for what the Python type
  cannot hold, e.g. ``infinity``, ``NaN``) replace the (None) typed value, as
  ``str``: the shell writes values in PostgreSQL's text input format, where the
  text is taken verbatim.
- Cuts: a TRUNCATE (``t``, sent at one position on every partition) at position
  P on partition p means "every target row that came from p with a position
  below P is gone". So do the GC control events (``snapshot_end``,
  ``backfill_end`` by default): every row the (re-)snapshot or backfill saw was
  rewritten at its position or later, the rest no longer exists at the source.
  Changes of the batch on p below p's highest cut are erased; so are changes
  below the partition's *floor* (the highest cut applied by earlier batches,
  which the shell keeps in its progress table). Cuts are per partition, never
  applied to another partition's rows.
- Scoped cuts: a ``backfill_end`` whose info (``_wb_control_info``, JSON:
  ``backfill_id, shape, lsn, partitions, rows, scope``) has a ``scope`` (key
  buckets, :mod:`schemas.buckets`) cuts only the target rows (and tombstones)
  of p in its buckets. Which rows those are only PostgreSQL can say, so a
  scoped cut is in ``scoped_cuts``, never in ``cuts``: it erases nothing of
  the batch and never raises the floor (other keys' changes below it are
  live). The shell runs it after the batch's writes, which is also right for
  in-scope changes of the batch below it. Malformed info or a scope naming a
  non-column is a :class:`PlanError` (a misread scope must not become a cut of
  the whole partition); a ``backfill_end`` without info is an unscoped cut.
- Every ``backfill_end`` with a ``backfill_id`` (scoped or not) is also in
  ``backfill_ends``: the shell records its partition and, once all the
  backfill's ``partitions`` have applied it, collects what it did not rewrite.
- Keyless shapes are a multiset of rows: ``c``/``r`` append (the shell dedupes
  live appends by position); ``d`` removes one row equal to the old row
  (``_wb_before`` if given, else the row columns, which the decoder fills from
  the envelope's ``before``); ``u`` removes one row equal to ``_wb_before``
  (its special values come from ``_wb_before_special``, as the new row's from
  ``_wb_special``) and appends the new row. A ``u`` without an old row was
  written while the table still had a key (the batch is decoded into the
  newest, keyless layout): it only appends, and the re-read the producer
  starts when a table loses its key cuts everything of that time. Inside the
  batch, a removal first cancels an earlier pending append of an equal row
  (across partitions); what remains removes target rows older than the
  removal (the shell runs it after the appends) or, finding none, waits for
  its row in the shape's tombstones (:mod:`spark_consumer.target_layout`).
- Control rows (``_wb_op`` null, ``_wb_control`` set) are returned in
  ``controls`` for the job; ``dlq`` rows (undecodable messages) are only
  counted: their offsets are covered by progress, their content is not applied.
- Stats are kept per (topic, partition) and count every input row exactly once:
  ``rows = planned + superseded + erased + below_floor + truncates + control + dlq``
  (a keyless ``u`` counts once even though it plans a removal and an append; a
  keyless change is ``superseded`` when a later removal cancelled its append).
- The plan is a list of flat tuples in staging order (column values, then
  ``STAGE_EXTRA``) so the shell can COPY them as they are; ``ApplyPlan.rows``
  gives readable :class:`PlannedRow` views. Planning is linear in the batch
  (one dict lookup per keyed row; only keys changed more than once are sorted).
- Known limits: an upsert whose unchanged-TOAST column neither the batch nor
  the target can supply (the key is new to the target) writes NULL there: the
  value is not in the stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Iterable, Mapping, Sequence

from schemas import wire
from spark_consumer.progress import Progress
from spark_consumer.shape_record import ShapeTarget

Position = tuple[int, int]

UPSERT, DELETE, APPEND, REMOVE = "u", "d", "a", "x"
DEFAULT_GC_CONTROLS = frozenset({wire.SNAPSHOT_END, wire.BACKFILL_END})

class PlanError(ValueError):
    """The batch holds a row this shape's apply cannot interpret."""


# ------------------------------------------------------------------ the plan
# A staged row is one flat tuple, in the order the shell COPYs it: the shape's
# column values, then these (offsets from the number of columns).
STAGE_EXTRA = (wire.KIND_COLUMN, wire.KEEP_COLUMN, wire.LSN_COLUMN, wire.OP_INDEX_COLUMN, wire.PARTITION_COLUMN,
               wire.OFFSET_COLUMN, wire.SNAPSHOT_ID_COLUMN)
_KIND, _KEEP, _LSN, _OPI, _PART, _OFF, _SNAP = range(7)


@dataclass(frozen=True, slots=True)
class PlannedRow:
    """A readable view of one staged row. ``values`` follow the shape's
    columns: Python values, or ``str`` PostgreSQL text for special values.
    ``keep``: columns whose target value is kept (unchanged TOAST the batch
    could not supply)."""

    kind: str  # UPSERT, DELETE (keyed) / APPEND, REMOVE (keyless)
    values: tuple
    lsn: int
    op_index: int
    partition: int
    offset: int
    snapshot_id: str | None = None
    keep: tuple[str, ...] = ()

    @property
    def position(self) -> Position:
        return (self.lsn, self.op_index)

    @classmethod
    def from_stage(cls, t: tuple, n: int) -> PlannedRow:
        return cls(t[n + _KIND], t[:n], t[n + _LSN], t[n + _OPI], t[n + _PART], t[n + _OFF], t[n + _SNAP],
                   tuple(t[n + _KEEP] or ()))


@dataclass(frozen=True, slots=True)
class Cut:
    """Target rows from ``partition`` below ``position`` are gone (TRUNCATE or
    a GC control event); with a ``scope``, only those in the scope's buckets."""

    partition: int
    lsn: int
    op_index: int
    offset: int
    reason: str  # "t" or the control event's name
    scope: Mapping | None = None  # scoped backfill_end: {"columns", "bucket_count", "buckets"}
    info: Mapping | None = None  # backfill_end: its parsed info (backfill_id, shape, lsn, partitions, rows, scope)

    @property
    def position(self) -> Position:
        return (self.lsn, self.op_index)

    @property
    def backfill_id(self) -> str | None:
        return self.info.get("backfill_id") if self.info else None




def make_cut(partition: int, lsn: int, op_index: int, offset: int, reason: str,
             info: Mapping | None = None) -> Cut:
    """A cut; a ``backfill_end``'s (already validated) info gives its scope."""
    if reason != wire.BACKFILL_END or not info:
        return Cut(partition, lsn, op_index, offset, reason)
    return Cut(partition, lsn, op_index, offset, reason, info.get("scope") or None, dict(info))


def backfill_info(target: ShapeTarget, raw: Any, where: str = "") -> dict | None:
    """Parse and check a ``backfill_end``'s ``_wb_control_info`` (None if absent)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, Mapping):
        info = dict(raw)
    else:
        try:
            info = json.loads(raw)
        except ValueError as e:
            raise PlanError(f"{where}: backfill_end info is not JSON: {e}") from None
    if not isinstance(info, dict):
        raise PlanError(f"{where}: backfill_end info is not a JSON object")
    scope = info.get("scope")
    if scope is not None:
        ok = (isinstance(scope, Mapping) and isinstance(scope.get("columns"), list) and scope["columns"]
              and isinstance(scope.get("bucket_count"), int) and scope["bucket_count"] > 0
              and isinstance(scope.get("buckets"), list) and all(isinstance(b, int) for b in scope["buckets"]))
        if not ok:
            raise PlanError(f"{where}: backfill_end scope {scope!r} is not "
                            "{columns: [...], bucket_count: n, buckets: [...]}")
        allowed = target.names if target.keyless else target.key_columns  # tombstones hold the key only
        unknown = [c for c in scope["columns"] if c not in allowed]
        if unknown:
            raise PlanError(f"{where}: backfill_end scope names {unknown}, not "
                            f"{'columns' if target.keyless else 'key columns'} of shape {target.shape!r}")
    if info.get("backfill_id") is not None:
        n = info.get("partitions")
        if not isinstance(n, int) or n < 1:
            raise PlanError(f"{where}: backfill_end of {info['backfill_id']!r} has no partition count")
    return info


def classify_cuts(events: Iterable[Cut]) -> tuple[dict[int, Cut], list[Cut], list[Cut]]:
    """A batch's cut events → (the highest unscoped cut per partition, the
    scoped cuts, the backfill_ends with a backfill id)."""
    cuts: dict[int, Cut] = {}
    scoped: list[Cut] = []
    backfills: list[Cut] = []
    for c in events:
        if c.scope:
            scoped.append(c)
        else:
            _add_cut(cuts, c)
        if c.backfill_id is not None:
            backfills.append(c)
    return cuts, scoped, backfills


@dataclass
class PlanStats:
    """What the planning did with one (topic, partition)'s rows."""

    rows: int = 0
    superseded: int = 0  # replaced by a newer change of the same key (keyless: appends a removal cancelled)
    erased: int = 0  # below a cut of the same batch
    below_floor: int = 0  # below a cut applied by an earlier batch
    truncates: int = 0
    control: int = 0
    dlq: int = 0
    max_position: Position | None = None
    max_offset: int = -1

    @property
    def planned(self) -> int:
        """Changes that became planned rows."""
        return self.rows - self.superseded - self.erased - self.below_floor - self.truncates - self.control - self.dlq


@dataclass
class ApplyPlan:
    target: ShapeTarget
    stage_rows: list[tuple]  # flat tuples: column values + STAGE_EXTRA
    cuts: dict[int, Cut]  # per partition: the highest cut of the batch
    controls: list[Mapping]
    stats: dict[tuple[str, int], PlanStats]
    keep_sets: list[tuple[str, ...]] = field(default_factory=list)  # distinct ``keep`` of upserts
    scoped_cuts: list[Cut] = field(default_factory=list)  # scoped backfill_ends: run by the shell only
    backfill_ends: list[Cut] = field(default_factory=list)  # backfill_ends with a backfill id (scoped or not)

    @property
    def rows(self) -> list[PlannedRow]:
        n = len(self.target.columns)
        return [PlannedRow.from_stage(t, n) for t in self.stage_rows]

    def count(self, kind: str) -> int:
        n = len(self.target.columns)
        return sum(1 for t in self.stage_rows if t[n] == kind)


def _hashable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    return v


# The bookkeeping fields the planner reads (see spark_consumer.decode), in the
# order they follow the shape's columns in the planner's row tuples.
PLAN_FIELDS = (wire.OP_COLUMN, wire.LSN_COLUMN, wire.OP_INDEX_COLUMN, wire.TOPIC_COLUMN, wire.PARTITION_COLUMN,
               wire.OFFSET_COLUMN, wire.UNCHANGED_COLUMN, wire.SPECIAL_COLUMN, wire.CONTROL_COLUMN,
               wire.CONTROL_INFO_COLUMN, wire.SNAPSHOT_ID_COLUMN, wire.BEFORE_COLUMN, wire.BEFORE_SPECIAL_COLUMN)


def field_index(fields: Sequence[str] | None, name: str) -> int | None:
    """Where ``name`` is in rows laid out by ``fields`` (None: rows are Mappings)."""
    if fields is None:
        return None
    try:
        return list(fields).index(name)
    except ValueError:
        raise PlanError(f"rows have no {name!r} field") from None


def field_getter(fields: Sequence[str] | None, name: str):
    """``row -> row[name]`` for Mapping rows, or rows laid out by ``fields``."""
    return itemgetter(name) if fields is None else itemgetter(field_index(fields, name))


def _getter(fields: Sequence[str] | None, name: str):
    """``row -> row[name]`` for Mapping rows (None if absent) or rows laid out by ``fields``."""
    i = field_index(fields, name)
    if i is None:
        return lambda r: r.get(name)
    return itemgetter(i)


def _as_dict(m: Any) -> dict:
    if not m:
        return {}
    return m if isinstance(m, dict) else dict(m)  # Arrow maps arrive as [(k, v), ...]


class _Columns:
    """Reads a row's column values by PostgreSQL name (decode.py's layout),
    falling back to the Avro field name."""

    def __init__(self, target: ShapeTarget):
        self.target = target
        self.index: dict[str, int] = {}
        for i, c in enumerate(target.columns):
            self.index[c.field] = i
            self.index[c.name] = i
        self._get: Any = None

    def _bind(self, row: Mapping) -> None:
        keys = [c.name if c.name in row else c.field for c in self.target.columns]
        if len(keys) == 1:
            k = keys[0]
            self._get = lambda r: (r[k],)
        elif keys:
            self._get = itemgetter(*keys)
        else:
            self._get = lambda r: ()

    def values(self, row: Mapping) -> tuple:
        if self._get is None:
            self._bind(row)
        try:
            return self._get(row)
        except KeyError:  # a row lacking a column: read what it has
            return tuple(row.get(c.name, row.get(c.field)) for c in self.target.columns)

    def idx(self, name: str, what: str) -> int:
        i = self.index.get(name)
        if i is None:
            raise PlanError(f"{what} names {name!r}, not a column of shape {self.target.shape!r}")
        return i

    def with_special(self, values: tuple, special: Any) -> tuple:
        out = list(values)
        for col, text in _as_dict(special).items():
            out[self.idx(col, wire.SPECIAL_COLUMN)] = text
        return tuple(out)

    def before(self, b: Any) -> tuple:
        values: list = [None] * len(self.target.columns)
        for col, v in _as_dict(b).items():
            values[self.idx(col, wire.BEFORE_COLUMN)] = v
        return tuple(values)


def _row_tuples(target: ShapeTarget, rows: Iterable, fields: Sequence[str] | None
                ) -> tuple[Sequence[tuple], tuple[int, ...], Sequence | None]:
    """The rows as tuples the planner indexes, where the shape's columns are
    ``row[:n]``, and the indexes of ``PLAN_FIELDS`` in them; plus the rows as
    mappings when they had to be converted (mapping rows, or a layout that
    lacks fields or has the columns elsewhere)."""
    n = len(target.columns)
    if fields is not None:
        fields = tuple(fields)
        if fields[:n] == target.names and all(f in fields for f in PLAN_FIELDS):
            rows = rows if isinstance(rows, Sequence) else list(rows)
            return rows, tuple(fields.index(f) for f in PLAN_FIELDS), None  # decode's layout: no copy
        for f in (wire.PARTITION_COLUMN, wire.OFFSET_COLUMN):
            field_index(fields, f)
        mappings = [dict(zip(fields, r)) for r in rows]
    else:
        mappings = rows if isinstance(rows, Sequence) else list(rows)
    cols = _Columns(target)
    tuples = [cols.values(r) + tuple(map(r.get, PLAN_FIELDS)) for r in mappings]
    return tuples, tuple(range(n, n + len(PLAN_FIELDS))), mappings


def plan_batch(target: ShapeTarget, rows: Iterable, *,
               floors: Mapping[int, Position] | None = None,
               gc_controls: Iterable[str] = DEFAULT_GC_CONTROLS, fields: Sequence[str] | None = None,
               keyless_pairs: bool = True) -> ApplyPlan:
    """Plan one micro-batch of one shape. ``rows``: Mappings (a row's fields by
    name) or, with ``fields``, sequences whose items ``fields`` names (e.g. one
    tuple per row of decode.py's columns, which is the fast form: nothing is
    copied). ``floors``: per partition, the highest cut already applied
    (changes below it are dropped). ``gc_controls``: control events that cut
    their partition at their position. ``keyless_pairs``: a keyless removal
    and an older equal append of the batch both vanish here; off for a target
    that keeps every removal with what it took (:mod:`spark_consumer.multiset`)."""
    gc = frozenset(gc_controls)
    floor_of = {int(p): tuple(f) for p, f in (floors or {}).items() if f is not None}
    cols = _Columns(target)
    n = len(target.columns)
    keyless = target.keyless
    stats: dict[tuple[str, int], PlanStats] = {}
    topic_of: dict[int, str] = {}
    events: list[Cut] = []
    controls: list[Mapping] = []
    data: list[tuple] = []
    append = data.append
    last_tp: Any = None
    st = PlanStats()
    rows, index, mappings = _row_tuples(target, rows, fields)
    (I_OP, I_LSN, I_OPI, I_TOPIC, I_PART, I_OFF, I_UNCH, I_SPECIAL, I_CONTROL, I_INFO, I_SNAP, I_BEFORE,
     I_BEFORE_SPECIAL) = index

    def control_row(i: int) -> Mapping:
        if mappings is not None:
            return mappings[i]
        return dict(zip(fields, rows[i]))

    for i, row in enumerate(rows):
        p = row[I_PART]
        off = row[I_OFF]
        topic = row[I_TOPIC]
        if p != last_tp or topic != topic_of.get(p):
            st = stats.get((topic, p))
            if st is None:
                if topic_of.setdefault(p, topic) != topic:
                    raise PlanError(f"partition {p} appears with topics {topic_of[p]!r} and {topic!r}: "
                                    "plan one shape (one topic) at a time")
                st = stats[(topic, p)] = PlanStats()
            last_tp = p
        st.rows += 1
        if off > st.max_offset:
            st.max_offset = off
        lsn = row[I_LSN]
        opi = row[I_OPI]
        if lsn is not None and opi is not None:
            mp = st.max_position
            if mp is None or lsn > mp[0] or (lsn == mp[0] and opi > mp[1]):
                st.max_position = (lsn, opi)
        op = row[I_OP]
        control = row[I_CONTROL]
        if op is None or control is not None:
            if control == wire.DLQ_CONTROL:
                st.dlq += 1
                continue
            if control == wire.TOMBSTONE_CONTROL:  # a delete's tombstone: its delete came before it
                st.control += 1
                continue
            if control is None:
                raise PlanError(f"row at {topic}[{p}]@{off} has neither _wb_op nor _wb_control")
            st.control += 1
            controls.append(control_row(i))
            if control in gc:
                info = None
                if control == wire.BACKFILL_END:
                    info = backfill_info(target, row[I_INFO], f"{topic}[{p}]@{off}")
                    if (lsn is None or opi is None) and info and info.get("lsn") is not None:
                        lsn, opi = int(info["lsn"]), 0  # a backfill_end's position is (S, 0)
                if lsn is not None and opi is not None:
                    events.append(make_cut(p, lsn, opi, off, control, info))
            continue
        if lsn is None or opi is None:
            raise PlanError(f"row at {topic}[{p}]@{off} has no position (_wb_lsn, _wb_op_index)")
        if op == "t":
            st.truncates += 1
            events.append(Cut(p, lsn, opi, off, "t"))
            continue
        values = row[:n] if row.__class__ is tuple else tuple(row[:n])
        special = row[I_SPECIAL]
        if special:
            values = cols.with_special(values, special)
        unchanged = row[I_UNCH]
        unch = tuple(cols.idx(u, wire.UNCHANGED_COLUMN) for u in unchanged) if unchanged else None
        snap = row[I_SNAP]
        if not keyless:
            if op == "d":
                append(values + ("d", None, lsn, opi, p, off, snap))
            elif op in ("c", "u", "r"):
                append(values + ("u", unch, lsn, opi, p, off, snap))
            else:
                raise PlanError(f"row at {topic}[{p}]@{off}: unknown _wb_op {op!r}")
            continue
        # Keyless: a removal (of the old row) sorts before the append of the same change.
        if op in ("c", "r"):
            if unch:
                raise PlanError(f"{target.shape}: an insert at {topic}[{p}]@{off} has unchanged TOAST columns")
            append(values + ("a", None, lsn, opi, p, off, snap))
            continue
        if op not in ("u", "d"):
            raise PlanError(f"row at {topic}[{p}]@{off}: unknown _wb_op {op!r}")
        b = row[I_BEFORE]
        if b is not None:
            old = cols.before(b)
            if row[I_BEFORE_SPECIAL]:  # the old row's special values (NaN, infinity, ...) as their text
                old = cols.with_special(old, row[I_BEFORE_SPECIAL])
        elif op == "d":
            old = values
        else:
            old = None  # written while the table had a key: the key-loss re-read replaces it
        if old is not None:
            append(old + ("x", None, lsn, opi, p, off, snap))
        if op == "u":
            if unch and old is not None:  # REPLICA IDENTITY FULL: the old row holds them
                new = list(values)
                for i in unch:
                    new[i] = old[i]
                values = tuple(new)
            append(values + ("a", None, lsn, opi, p, off, snap))

    # Cuts and floors erase what lies below them on their partition (scoped
    # cuts do not: which rows they cover only the target can tell).
    cuts, scoped_cuts, backfill_ends = classify_cuts(events)
    limits = dict(floor_of)
    for p, c in cuts.items():
        if p not in limits or c.position > limits[p]:
            limits[p] = c.position

    def stat(t: tuple) -> PlanStats:
        p = t[n + _PART]
        return stats[(topic_of[p], p)]

    def gone(t: tuple) -> bool:
        p = t[n + _PART]
        lim = limits.get(p)
        if lim is None:
            return False
        pos = (t[n + _LSN], t[n + _OPI])
        if pos >= lim:
            return False
        f = floor_of.get(p)
        if f is not None and pos < f:
            stat(t).below_floor += 1
        else:
            stat(t).erased += 1
        return True

    if limits:
        data = [t for t in data if not gone(t)]
    if keyless:
        out = _plan_keyless(data, n, stat) if keyless_pairs else data
    else:
        out = _plan_keyed(target, data, n, stat)
    keep_sets = sorted({tuple(t[n + _KEEP] or ()) for t in out if t[n + _KIND] == UPSERT})
    return ApplyPlan(target, out, cuts, controls, stats, keep_sets, scoped_cuts, backfill_ends)


def _add_cut(cuts: dict[int, Cut], cut: Cut) -> None:
    old = cuts.get(cut.partition)
    if old is None or cut.position > old.position:
        cuts[cut.partition] = cut


def _sort_key(n: int):
    lsn, opi, part, off, snap = n + _LSN, n + _OPI, n + _PART, n + _OFF, n + _SNAP
    return lambda t: (t[lsn], t[opi], t[snap] is None, t[part], t[off])


def _rank(t: tuple, n: int) -> tuple:
    """Position, then streamed over snapshot (see the module docstring)."""
    return t[n + _LSN], t[n + _OPI], t[n + _SNAP] is None


def _plan_keyed(target: ShapeTarget, data: list[tuple], n: int, stat) -> list[tuple]:
    key_idx = [i for i, c in enumerate(target.columns) if c.is_key]
    key_of = itemgetter(*key_idx)  # a scalar for one key column, else a tuple
    latest: dict[Any, tuple] = {}
    chains: dict[Any, list[tuple]] = {}
    setdefault = latest.setdefault
    for t in data:
        key = key_of(t)
        try:
            prev = setdefault(key, t)
        except TypeError:  # unhashable key value (an array key)
            key = _hashable(key)
            prev = setdefault(key, t)
        if prev is not t:
            chain = chains.get(key)
            if chain is None:
                chains[key] = [prev, t]
            else:
                chain.append(t)
    if None in latest or (len(key_idx) > 1 and any(k is None for key in latest for k in key)):
        bad = next(t for t in data if key_of(t) is None or (len(key_idx) > 1 and None in key_of(t)))
        raise PlanError(f"{target.shape}: change at partition {bad[n + _PART]} offset {bad[n + _OFF]} "
                        "has a null key column")
    order = _sort_key(n)
    for key, chain in chains.items():
        chain.sort(key=order)
        for older in chain[:-1]:
            stat(older).superseded += 1
        latest[key] = _merge_toast(chain, n) if chain[-1][n + _KEEP] else chain[-1]
    names = target.names
    out = list(latest.values())
    for i, t in enumerate(out):
        unch = t[n + _KEEP]
        if unch:  # unchanged TOAST no earlier change supplied: keep the target's value
            out[i] = t[:n + _KEEP] + (sorted(names[j] for j in unch),) + t[n + _KEEP + 1:]
    return out


def _merge_toast(chain: list[tuple], n: int) -> tuple:
    """The chain's last change with its unchanged-TOAST columns filled from the
    latest earlier change (after the last delete) that carried them."""
    last = chain[-1]
    values = list(last[:n])
    missing = []
    for i in last[n + _KEEP]:
        for t in reversed(chain[:-1]):
            if t[n + _KIND] == DELETE:
                missing.append(i)
                break
            if not t[n + _KEEP] or i not in t[n + _KEEP]:
                values[i] = t[i]
                break
        else:
            missing.append(i)
    return tuple(values) + (last[n + _KIND], tuple(missing) or None) + last[n + _KEEP + 1:]


def _content(t: tuple, n: int) -> Any:
    v = t[:n]
    try:
        hash(v)
        return v
    except TypeError:
        return _hashable(v)


def _plan_keyless(data: list[tuple], n: int, stat) -> list[tuple]:
    kind = n + _KIND
    if all(t[kind] == APPEND for t in data):
        return data  # insert-only (the common case): nothing to match
    data = sorted(data, key=_sort_key(n))  # stable: a change's removal stays before its append
    appends: list[tuple | None] = []
    removals: list[tuple] = []
    pending: dict[Any, list[int]] = {}  # row content -> indexes of not yet cancelled appends
    for t in data:
        content = _content(t, n)
        if t[kind] == APPEND:
            pending.setdefault(content, []).append(len(appends))
            appends.append(t)
            continue
        slots = pending.get(content)
        if slots and _rank(appends[slots[-1]], n) < _rank(t, n):
            j = slots.pop()  # an equal row appended earlier in this batch: both vanish
            stat(appends[j]).superseded += 1
            appends[j] = None
        else:
            removals.append(t)
    return [a for a in appends if a is not None] + removals


# ------------------------------------------------------------ replay filtering
class OffsetResetError(RuntimeError):
    """Rows at offsets progress says were applied carry newer positions than
    anything applied there: the topic-partition was recreated (Kafka lost its
    data) or progress belongs to another topic incarnation."""


def split_replayed(rows: Sequence, progress: Progress | None, *, where: str = "",
                   on_offset_reset: str = "raise", fields: Sequence[str] | None = None) -> tuple[list, int, bool]:
    """Split one partition's rows (Mappings, or sequences laid out by
    ``fields``) into those still to apply and the count of those progress
    already covers (``offset < next_offset``). A row below ``next_offset``
    whose position is above the applied position cannot be a replay
    (positions only grow within a partition): ``on_offset_reset`` =
    ``"raise"`` raises :class:`OffsetResetError`, ``"follow"`` applies the whole
    part (positions guard every write) and returns ``reset=True``."""
    if progress is None:
        return list(rows), 0, False
    nxt = progress.next_offset
    offset_of = field_getter(fields, wire.OFFSET_COLUMN)
    lsn_of, opi_of = _getter(fields, wire.LSN_COLUMN), _getter(fields, wire.OP_INDEX_COLUMN)
    todo, skipped = [], 0
    for row in rows:
        if int(offset_of(row)) >= nxt:
            todo.append(row)
            continue
        lsn, opi = lsn_of(row), opi_of(row)
        pos = (int(lsn), int(opi)) if lsn is not None and opi is not None else None
        if pos is not None and (progress.applied is None or pos > tuple(progress.applied)):
            if on_offset_reset == "follow":
                return list(rows), 0, True
            raise OffsetResetError(
                f"{where}: the row at offset {offset_of(row)} has position {pos}, above the applied "
                f"{progress.applied}, yet progress says offsets below {nxt} are applied: the partition was "
                "reset (Kafka lost its data?). Apply with on_offset_reset='follow' to re-apply by position.")
        skipped += 1
    return todo, skipped, False
