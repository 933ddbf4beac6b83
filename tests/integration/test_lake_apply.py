"""Each lakehouse target (Delta Lake, Apache Iceberg in a Hadoop catalog),
batch by batch on real Spark, no Kafka: a keyless (REPLICA IDENTITY FULL,
no primary key) shape under the PostgreSQL target's multiset rules
(duplicates, a removal taking one equal row, a removal that waits for its
row from another partition, a replayed append landing once, a removal after
a backfill's start taking the re-read copy), a crash between a batch's
kept-removals commit and its table commit, upkeep between batches, and a
keyed shape following renames, a drop, a widening and an added column, and
a backfill of some key buckets applied as changes, collecting nothing.
Tables are read back with each format's own reader (delta-rs, pyiceberg),
not Spark."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from pyiceberg.table import StaticTable

from producer.envelope import ShapeCodec, ShapeColumn
from producer.pgtypes import PgTypeInfo, column_codec
from schemas import wire
from schemas.config import IcebergConfig
from spark_consumer.batch import Part
from spark_consumer.session import spark_session
from spark_consumer.shape_record import ShapeTarget
from spark_consumer.targets import delta, iceberg, lake
from spark_consumer.targets.base import ShapeBatch
from spark_consumer.targets.delta import DeltaTarget
from spark_consumer.targets.iceberg import IcebergTarget
from tests.helpers import both_lake_formats
from tests.unit.test_apply_plan import TOPIC, keyless_target, lrow

GROUP = "g-keyless"
CATALOG = "lakeapply"


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("iceberg-warehouse")


@pytest.fixture(scope="module")
def spark(warehouse):
    session = spark_session("local[2]", target_settings=both_lake_formats(str(warehouse), CATALOG), jvm_applies=True)
    yield session
    session.stop()


class Lake:
    """One format's targets in a test's own place, and its rows as the
    format's own reader reads them."""

    def __init__(self, kind: str, spark, tmp_path: Path, warehouse: Path):
        self.kind, self.spark = kind, spark
        self.root = str(tmp_path / "lake")
        self.namespace = "ns_" + re.sub(r"\W", "_", tmp_path.name)[-40:]
        self.warehouse = warehouse

    def target(self, **kwargs) -> lake.LakeTarget:
        if self.kind == "delta":
            return DeltaTarget(self.spark, self.root, **kwargs)
        return IcebergTarget(self.spark, IcebergConfig(warehouse=str(self.warehouse), name=CATALOG,
                                                       namespace=self.namespace), **kwargs)

    def rows(self, which: str = "table") -> Counter:
        """The table's rows, or (``"pending"``) the removals that wait for their row."""
        waiting = f"{wire.TOOK_COLUMNS[0]} IS NULL"
        if self.kind == "delta":
            path = f"{self.root}/log" if which == "table" else f"{self.root}/{delta.TOMBSTONES_DIR}/log"
            where = "" if which == "table" else f" WHERE {waiting}"
            data = pa.table(QueryBuilder().register("t", DeltaTable(path)).execute(f"SELECT a, b FROM t{where}")
                            .read_all())
        else:
            data = self.iceberg_table(which).scan(row_filter="True" if which == "table" else waiting,
                                                  selected_fields=("a", "b")).to_arrow()
        return Counter((r["a"], r["b"]) for r in data.to_pylist())

    def iceberg_table(self, which: str = "table", name: str = "log"):
        ns = self.namespace + ("" if which == "table" else iceberg.TOMBSTONES_SUFFIX)
        found = sorted((int(re.search(r"v(\d+)", f.name).group(1)), f)
                       for f in (self.warehouse / ns / name / "metadata").glob("v*.metadata.json"))
        return StaticTable.from_metadata(str(found[-1][1]))

    def read(self, name: str, which: str = "table") -> pa.Table:
        """A table as the format's own reader reads it, every column."""
        if self.kind == "delta":
            path = f"{self.root}/{name}" if which == "table" else f"{self.root}/{delta.TOMBSTONES_DIR}/{name}"
            return pa.table(QueryBuilder().register("t", DeltaTable(path)).execute("SELECT * FROM t").read_all())
        return self.iceberg_table(which, name).scan().to_arrow()

    def newest(self) -> tuple[str, str | None]:
        """The table's newest commit: (operation, the record it carries)."""
        if self.kind == "delta":
            h = DeltaTable(f"{self.root}/log").history()[0]
            return h["operation"], h.get("userMetadata")
        snap = self.iceberg_table().current_snapshot()
        return snap.summary.operation.value, snap.summary.get(wire.ICEBERG_PROGRESS_PROPERTY)

    def data_files(self) -> int:
        if self.kind == "delta":
            return len(DeltaTable(f"{self.root}/log").file_uris())
        return self.iceberg_table().inspect.files().num_rows


@pytest.fixture(params=["delta", "iceberg"])
def lakes(request, spark, tmp_path, warehouse) -> Lake:
    return Lake(request.param, spark, tmp_path, warehouse)


def backfill_end_control(backfill_id: str, shape: str, lsn: int, scope: dict | None) -> dict:
    """The control columns of a one-partition backfill's end."""
    return {"_wb_control": "backfill_end", "_wb_control_info": json.dumps(
        {"backfill_id": backfill_id, "shape": shape, "lsn": lsn, "partitions": 1, "rows": 0, "scope": scope})}


class Feed:
    """Batches of one keyless shape's topic (two partitions), offsets counted per partition."""

    def __init__(self, target: lake.LakeTarget):
        self.target, self.shape = target, keyless_target()
        self.next = {0: 0, 1: 0}
        self.held: list[str] = []

    def row(self, op, lsn, p=0, snap=None, **values):
        r = lrow(op, lsn, p=p, off=self.next[p], **values)
        r["_wb_snapshot_id"] = snap
        self.next[p] += 1
        return r

    def backfill_end(self, backfill_id: str, lsn: int, scope: dict | None = None) -> dict:
        """A one-partition backfill's end on partition 0, as the producer writes it."""
        return {**self.row(None, lsn, snap=backfill_id), **backfill_end_control(backfill_id, "log", lsn, scope)}

    def apply(self, rows, start=None, follow=False):
        parts = []
        for p in (0, 1):
            mine = [r for r in rows if r["_wb_partition"] == p]
            if mine:
                first = start[p] if start else mine[0]["_wb_offset"]
                parts.append(Part(TOPIC, p, first, mine[-1]["_wb_offset"] + 1, mine))
        return self.target.apply(GROUP, [ShapeBatch(TOPIC, self.shape, parts, follow)], on_offset_reset="raise",
                                 hold=lambda topic, why: self.held.append(why))


def started(lakes: Lake, **kwargs) -> tuple[lake.LakeTarget, Feed]:
    target = lakes.target(**kwargs)
    feed = Feed(target)
    target.follow(TOPIC, feed.shape)
    target.read_progress(GROUP)
    return target, feed


def test_a_keyless_shape_is_a_multiset_of_rows(lakes):
    _, feed = started(lakes)
    # A snapshot with a row three times (its rows share the snapshot's position).
    feed.apply([feed.row("r", 50, a=1, b="x", snap="s1") for _ in range(3)] + [feed.row("r", 50, a=2, b="y",
                                                                                         snap="s1")])
    assert lakes.rows() == Counter({(1, "x"): 3, (2, "y"): 1})
    # A delete takes one of the equal rows; an update replaces its old row.
    feed.apply([feed.row("d", 100, a=1, b="x"), feed.row("u", 101, a=2, b="z", before={"a": 2, "b": "y"}),
                feed.row("c", 102, a=3, b="w"), feed.row("c", 103, a=3, b="w")])
    assert lakes.rows() == Counter({(1, "x"): 2, (2, "z"): 1, (3, "w"): 2})
    # A removal on partition 1 ahead of its row (an older insert on partition
    # 0, in a later batch) waits, then cancels that insert; a newer equal insert lands.
    feed.apply([feed.row("d", 200, p=1, a=5, b="q")])
    assert lakes.rows("pending") == Counter({(5, "q"): 1}) and (5, "q") not in lakes.rows()
    result = feed.apply([feed.row("c", 150, a=5, b="q"), feed.row("c", 250, a=5, b="q")])
    assert lakes.rows()[(5, "q")] == 1 and lakes.rows("pending") == Counter()
    assert sum(r.cancelled for r in result.parts.values()) == 1
    # Deleting every copy; a restart reads the progress and skips the replayed range.
    feed.apply([feed.row("d", 300, a=3, b="w"), feed.row("d", 301, a=3, b="w")])
    assert (3, "w") not in lakes.rows()
    _, again = started(lakes)
    replay = [lrow("c", 102, off=6, a=3, b="w")]  # offset 6 of partition 0: applied before
    again.next = dict(feed.next)
    again.apply(replay + [again.row("c", 400, a=6, b="v")], start={0: 6, 1: again.next[1]})
    assert lakes.rows() == Counter({(1, "x"): 2, (2, "z"): 1, (5, "q"): 1, (6, "v"): 1})
    assert not feed.held and not again.held


@pytest.mark.parametrize("order", ["re-read copy first", "removal first", "removal in the append's batch"])
def test_a_removal_after_a_backfill_start_takes_the_re_read_copy(lakes, order):
    """The source holds (1,x) twice and (2,y) once; a backfill re-reads them at
    500; after 500 one (1,x) and the (2,y) are removed. However the re-read
    copies and the removals interleave, the backfill's end leaves one (1,x)."""
    _, feed = started(lakes)
    before = lambda: [feed.row("c", 100, a=1, b="x"), feed.row("c", 110, a=1, b="x")]
    old_y = lambda: [feed.row("c", 120, a=2, b="y")]
    reread = lambda: [feed.row("r", 500, a=a, b=b, snap="bf1") for a, b in ((1, "x"), (1, "x"), (2, "y"))]
    removals = lambda: [feed.row("d", 600, a=1, b="x"), feed.row("d", 610, a=2, b="y")]
    if order == "re-read copy first":
        batches = [lambda: before() + old_y(), reread, removals]
    elif order == "removal first":
        batches = [lambda: before() + old_y(), removals, reread]
    else:
        batches = [before, lambda: old_y() + removals(), reread]
    for batch in batches:
        feed.apply(batch())
    feed.apply([feed.backfill_end("bf1", 500)])
    assert lakes.rows() == Counter({(1, "x"): 1}) and not feed.held


def test_a_crash_between_the_pending_and_the_table_commit_is_rolled_back(lakes, monkeypatch):
    """The append cancelled by a pending removal consumes it in the pending
    commit; the crash comes before the table commit. The next start rolls
    the pending removals back, and the batch applied again cancels the append
    again (without the roll-back it would land: a row the source does not have)."""
    _, feed = started(lakes)
    feed.apply([feed.row("c", 10, a=1, b="kept")])
    feed.apply([feed.row("d", 300, p=1, a=7, b="k")])
    assert lakes.rows("pending") == Counter({(7, "k"): 1})
    older = feed.row("c", 280, a=7, b="k")

    def crash(*args, **kwargs):
        raise RuntimeError("killed between the commits")

    with monkeypatch.context() as m:
        m.setattr(lake, "keyless_table_merge", crash)
        with pytest.raises(RuntimeError, match="between the commits"):
            feed.apply([older])
    assert lakes.rows("pending") == Counter()  # the pending commit landed, the table's did not
    _, again = started(lakes)
    assert lakes.rows("pending") == Counter({(7, "k"): 1})
    again.apply([older])
    assert lakes.rows() == Counter({(1, "kept"): 1}) and lakes.rows("pending") == Counter()
    assert '"commits":3' in lakes.newest()[1]


def test_compaction_and_vacuum_between_batches_change_no_row(lakes, monkeypatch):
    """Many small commits, then the upkeep the target runs between batches
    when due: compaction leaves fewer files and the same rows, its commit
    (or the one after it) carries the record; a vacuum keeping no history
    leaves the rows and the progress as they were; a table not written since
    its last compaction is not compacted again."""
    now = [0.0]
    target, feed = started(lakes, upkeep=lake.Upkeep(60, 120, 0), clock=lambda: now[0])
    for i in range(6):
        feed.apply([feed.row("c", 10 + i, a=i, b="x"), feed.row("c", 10 + i, p=1, a=i, b="y")])
    feed.apply([feed.row("d", 100, a=2, b="x")])
    before = lakes.rows()
    files = lakes.data_files()
    assert files >= 6
    now[0] = 61  # compaction due after the next batch
    feed.apply([feed.row("c", 200, a=9, b="z")])
    assert lakes.data_files() < files
    assert lakes.rows() == before + Counter({(9, "z"): 1})
    assert '"commits":8' in lakes.newest()[1]  # the record, on the newest commit again
    now[0] = 121  # vacuum due (and compaction again)
    feed.apply([feed.row("c", 300, a=10, b="z")])
    assert lakes.rows() == before + Counter({(9, "z"): 1, (10, "z"): 1})
    if lakes.kind == "delta":  # the files no version needs are gone
        parquet = list(Path(lakes.root, "log").glob("*.parquet"))
        assert len(parquet) == lakes.data_files()
    else:  # the snapshots before the newest are expired
        assert len(lakes.iceberg_table().snapshots()) == 1
    # Due again with no table written since the last compaction: none is compacted.
    upkept = []
    monkeypatch.setattr(target, "_keep_up_table", lambda ref, command, record: upkept.append((ref, command)))
    now[0] = 200
    target.apply(GROUP, [], on_offset_reset="raise", hold=lambda topic, why: pytest.fail(why))
    assert upkept == []
    # The progress is still the newest commit's record.
    again, _ = started(lakes)
    assert again.read_progress(GROUP) == target.read_progress(GROUP)


INT, INT8, TEXT = (PgTypeInfo(23, "integer", 23, "integer", -1, "b"), PgTypeInfo(20, "bigint", 20, "bigint", -1, "b"),
                   PgTypeInfo(25, "text", 25, "text", -1, "b"))


def items_shape(version: int) -> ShapeTarget:
    """Version 1, then version 2: the key and a column renamed, a column
    widened (integer to bigint), one dropped, one added; version 3: no key."""
    if version == 1:
        cols = [ShapeColumn("id", column_codec(INT), True), ShapeColumn("label", column_codec(TEXT), False),
                ShapeColumn("qty", column_codec(INT), False), ShapeColumn("gone", column_codec(TEXT), False)]
    else:
        cols = [ShapeColumn("ident", column_codec(INT), version == 2, aliases=("id",)),
                ShapeColumn("title", column_codec(TEXT), False, aliases=("label",)),
                ShapeColumn("qty", column_codec(INT8), False), ShapeColumn("note", column_codec(TEXT), False)]
    codec = ShapeCodec("items", "wb", "app", "public", "items", cols, list(range(len(cols))))
    return ShapeTarget.from_avro("items", codec.value_schema, codec.key_schema)


class KeyedFeed:
    """Batches of one keyed shape's topic (one partition): rows as
    ``(op, lsn, values)``; values may set bookkeeping (``_wb_snapshot_id``,
    ``_wb_control``, ``_wb_control_info``)."""

    def __init__(self, topic: str = "wb.items"):
        self.topic, self.offsets = topic, iter(range(1000))
        self.held: list[str] = []

    def apply(self, target, shape, rows):
        rows = [{"_wb_op": op, "_wb_lsn": lsn, "_wb_op_index": 0, "_wb_topic": self.topic, "_wb_partition": 0,
                 "_wb_offset": next(self.offsets), "_wb_unchanged": None, "_wb_special": None, "_wb_control": None,
                 "_wb_snapshot_id": None, "_wb_ts_ms": 0, **values} for op, lsn, values in rows]
        part = Part(self.topic, 0, rows[0]["_wb_offset"], rows[-1]["_wb_offset"] + 1, rows)
        target.apply(GROUP, [ShapeBatch(self.topic, shape, [part], False)], on_offset_reset="raise",
                     hold=lambda t, why: pytest.fail(why))


def backfill_end(backfill_id: str, lsn: int, scope: dict | None) -> tuple:
    """A one-partition backfill's end of ``items``, as the producer writes it."""
    return (None, lsn, {"_wb_snapshot_id": backfill_id, **backfill_end_control(backfill_id, "items", lsn, scope)})


def test_a_backfill_of_some_buckets_is_applied_as_changes_and_collects_nothing(lakes):
    """Another consumer group's reconcile re-reads some key buckets at 500:
    its rows converge by key (a newer change stays), and its end collects
    nothing, since only PostgreSQL can say which rows its buckets hold; a
    later whole-shape backfill collects what it did not re-read. On a keyless
    shape (both copies would stay) the same backfill holds the shape."""
    shape, feed = items_shape(1), KeyedFeed()
    target = lakes.target()
    target.follow(feed.topic, shape)
    target.read_progress(GROUP)
    feed.apply(target, shape, [("c", 100 + i, {"id": i, "label": f"v{i}", "qty": i, "gone": None})
                               for i in (1, 2, 3)])
    scope = {"columns": ["id"], "bucket_count": 4, "buckets": [0, 1, 2, 3]}
    feed.apply(target, shape, [("u", 600, {"id": 2, "label": "newer", "qty": 2, "gone": None}),
                               ("r", 500, {"id": 1, "label": "re-read", "qty": 1, "gone": None,
                                           "_wb_snapshot_id": "bf1"}),
                               ("r", 500, {"id": 2, "label": "re-read", "qty": 2, "gone": None,
                                           "_wb_snapshot_id": "bf1"}),
                               backfill_end("bf1", 500, scope)])

    def rows():
        return sorted((r["id"], r["label"]) for r in lakes.read("items").to_pylist())

    assert rows() == [(1, "re-read"), (2, "newer"), (3, "v3")]  # 3, not re-read, is kept
    # A keyed table keeps the offset of a snapshot row only (what tells a snapshot's rows apart).
    assert {r["id"]: r["_wb_offset"] is not None for r in lakes.read("items").to_pylist()} == {
        1: True, 2: False, 3: False}
    feed.apply(target, shape, [("r", 700, {"id": i, "label": "whole", "qty": i, "gone": None,
                                           "_wb_snapshot_id": "bf2"}) for i in (1, 2)]
               + [backfill_end("bf2", 700, None)])
    assert rows() == [(1, "whole"), (2, "whole")]

    _, keyless = started(lakes)
    append = keyless.row("c", 100, a=1, b="x")
    keyless.apply([append, keyless.backfill_end("bf3", 500, {**scope, "columns": ["a", "b"]})])
    assert keyless.held and "bf3" in keyless.held[0]


def test_a_keyed_shape_follows_renames_a_drop_a_widening_an_added_column_and_a_lost_key(lakes):
    feed = KeyedFeed()
    topic, apply = feed.topic, feed.apply

    v1, v2 = items_shape(1), items_shape(2)
    target = lakes.target(on_dropped_column="drop")
    target.follow(topic, v1)
    target.read_progress(GROUP)
    apply(target, v1, [("c", 10, {"id": 1, "label": "one", "qty": 5, "gone": "x"}),
                       ("c", 11, {"id": 2, "label": "two", "qty": 6, "gone": "y"}),
                       ("d", 12, {"id": 2})])
    target.follow(topic, v2)  # as the first batch of the new writer schema does
    apply(target, v2, [("u", 20, {"ident": 1, "title": "uno", "qty": 2**40, "note": "big"}),
                       ("c", 21, {"ident": 3, "title": "three", "qty": 7, "note": None}),
                       ("c", 11, {"ident": 2, "title": "two", "qty": 6, "note": None})])  # older than its delete
    again = lakes.target(on_dropped_column="drop")  # a restart follows the same schema: nothing to do
    again.follow(topic, v2)
    again.read_progress(GROUP)
    apply(again, v2, [("d", 30, {"ident": 3})])
    table = lakes.read("items")
    assert [n for n in table.column_names if not n.startswith("_wb_")] == ["ident", "title", "qty", "note"]
    assert pa.types.is_int64(table.schema.field("qty").type)
    assert sorted((r["ident"], r["title"], r["qty"], r["note"]) for r in table.to_pylist()) == [
        (1, "uno", 2**40, "big")]
    tombstones = lakes.read("items", "tombstones")
    assert sorted(r["ident"] for r in tombstones.to_pylist()) == [2, 3]
    # The table loses its key: it follows the keyless rules, its tombstones made anew for them.
    v3 = items_shape(3)
    again.follow(topic, v3)
    apply(again, v3, [("c", 40, {"ident": 1, "title": "uno", "qty": 2**40, "note": "big"}),
                      ("d", 41, {"ident": 1, "title": "uno", "qty": 2**40, "note": "big"})])
    assert sorted((r["ident"], r["title"]) for r in lakes.read("items").to_pylist()) == [(1, "uno")]
    tombstones = lakes.read("items", "tombstones")
    assert tombstones.num_rows == 1 and wire.TOOK_COLUMNS[0] in tombstones.column_names
    # A removal takes the row a keyed batch streamed (no offset: its position tells it apart).
    apply(again, v3, [("d", 50, {"ident": 1, "title": "uno", "qty": 2**40, "note": "big"})])
    assert lakes.read("items").num_rows == 0


def test_an_unchanged_toast_column_keeps_the_tables_value(lakes):
    """An update that left a column unchanged (TOAST, ``_wb_unchanged``)
    keeps the table's value there and sets the others; a batch where no
    row keeps a column (its stage handed to Spark without the keep column)
    and one where some do apply alike."""
    shape, feed = items_shape(1), KeyedFeed()
    target = lakes.target()
    target.follow(feed.topic, shape)
    target.read_progress(GROUP)
    feed.apply(target, shape, [("c", 10 + i, {"id": i, "label": f"long {i}", "qty": i, "gone": None})
                               for i in (1, 2)])
    feed.apply(target, shape, [("u", 20, {"id": 1, "label": None, "qty": 10, "gone": None,
                                          "_wb_unchanged": ["label"]}),
                               ("u", 21, {"id": 2, "label": "new 2", "qty": 20, "gone": None})])
    feed.apply(target, shape, [("u", 30, {"id": 2, "label": "newer 2", "qty": 21, "gone": None})])
    assert sorted((r["id"], r["label"], r["qty"]) for r in lakes.read("items").to_pylist()) == [
        (1, "long 1", 10), (2, "newer 2", 21)]
