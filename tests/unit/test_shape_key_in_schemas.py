"""A consumer always knows a shape's key from the value schema it decodes
with. The row record names its key fields (``pg.key``), so a key change alone
(a new primary key, a key lost) makes a new value schema; and the producer
publishes the key schema before the value schema. Before, a consumer that
started between the two publications, or a shape whose key was dropped (its
key subject keeping the old version), took a keyed shape for a keyless one or
the other way round: a target table without its primary key, updates
appended as new rows."""

from dataclasses import replace
from types import SimpleNamespace

from producer.envelope import value_schema
from producer.pipeline import Pipeline
from producer.schema_changes import from_published
from spark_consumer.decode import ShapeLayout
from spark_consumer.shape_record import ShapeTarget
from tests.unit.test_envelope import codec


def _key_schema(*fields: str) -> dict:
    return {"type": "record", "name": "Key", "fields": [{"name": f, "type": "int"} for f in fields]}


def test_the_row_record_names_its_key_fields():
    c = codec("plain")
    assert c.value_schema["fields"][0]["type"][1]["pg.key"] == ["id"]
    keyless = value_schema("ns", [replace(col, is_key=False) for col in c.columns])
    assert keyless["fields"][0]["type"][1]["pg.key"] == []


def test_the_consumer_takes_the_key_from_the_value_schema_over_a_lagging_key_subject():
    keyed = codec("plain").value_schema
    unkeyed = value_schema("ns", [replace(col, is_key=False) for col in codec("plain").columns])
    # keyed value schema, key subject not (yet) found
    assert ShapeTarget.from_avro("s", keyed, None).key_columns == ("id",)
    assert ShapeLayout.from_schemas(keyed, None).key_columns == ("id",)
    # the key was dropped: the key subject still has its last version
    assert ShapeTarget.from_avro("s", unkeyed, _key_schema("id")).keyless
    assert ShapeLayout.from_schemas(unkeyed, _key_schema("id")).key_columns == ()
    # a value schema written before pg.key: the key schema decides
    old = codec("plain").value_schema
    del old["fields"][0]["type"][1]["pg.key"]
    assert ShapeTarget.from_avro("s", old, _key_schema("id")).key_columns == ("id",)
    assert ShapeTarget.from_avro("s", old, None).keyless


def test_a_restarted_producer_reads_the_published_key_from_the_value_schema():
    unkeyed = value_schema("ns", [replace(col, is_key=False) for col in codec("plain").columns])
    def type_name(oid: int, typmod: int) -> str:
        return "int"

    assert from_published([(codec("plain").value_schema, None)], type_name, "d").key == ("id",)
    assert from_published([(unkeyed, _key_schema("id"))], type_name, "d").key == ()


class Publisher:
    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []

    def prefix(self, topic: str, schema: dict, is_key: bool = False) -> bytes:
        self.published.append(("key" if is_key else "value", topic))
        return b"\x00"


def test_the_key_schema_is_published_before_the_value_schema():
    publisher = Publisher()
    codec = SimpleNamespace(value_schema={"type": "record"}, key_schema={"type": "record"})
    Pipeline._register(SimpleNamespace(schemas=publisher), codec, "p.public.t")
    assert publisher.published == [("key", "p.public.t"), ("value", "p.public.t")]
    assert codec.key_prefix == codec.value_prefix == b"\x00"


def test_a_keyless_shape_publishes_its_value_schema_alone():
    publisher = Publisher()
    codec = SimpleNamespace(value_schema={"type": "record"}, key_schema=None)
    Pipeline._register(SimpleNamespace(schemas=publisher), codec, "p.public.h")
    assert publisher.published == [("value", "p.public.h")] and codec.key_prefix is None
