"""A consumer that finds a shape's value schema finds its key schema too: the
producer publishes the key schema first. Found the other way round, a consumer
starting between the two took a keyed shape for a keyless one (a target table
without its primary key, updates appended as new rows)."""

from types import SimpleNamespace

from producer.pipeline import Pipeline


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
