"""Writer schemas on the schemas topic (schemas/publisher.py): published
together, in order, and cached only once Kafka has acknowledged them."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from schemas import wire
from schemas.publisher import SchemaPublisher

VALUE = {"type": "record", "name": "Value", "namespace": "wb.db.t", "fields": [{"name": "id", "type": "int"}]}
KEY = {"type": "record", "name": "Key", "namespace": "wb.db.t", "fields": [{"name": "id", "type": "int"}]}


class Broker:
    """A producer whose deliveries are reported at the next poll, failed with ``error`` if set."""

    def __init__(self, error: KafkaError | None = None):
        self.sent: list[tuple[str, bytes, list]] = []
        self.polls = 0
        self._waiting: list = []
        self.error = error

    def produce(self, topic, value, key, headers=None, on_delivery=None):
        self.sent.append((topic, key, headers))
        self._waiting.append(on_delivery)

    def poll(self, timeout):
        self.polls += 1
        waiting, self._waiting = self._waiting, []
        for report in waiting:
            report(self.error, None)


def subjects(broker: Broker) -> list[str]:
    return [dict(headers)[wire.SUBJECT_HEADER].decode() for _, _, headers in broker.sent]


def test_schemas_asked_for_together_are_sent_at_the_end_in_order_and_waited_for_at_once():
    broker = Broker()
    publisher = SchemaPublisher(broker, "wb", None)
    alone = SchemaPublisher(Broker(), "wb", None).prefix("wb.t", VALUE)
    with publisher.together():
        prefixes = [publisher.prefix(t, KEY, is_key=True) for t in ("wb.t", "wb.u")]
        prefixes.append(publisher.prefix("wb.t", VALUE))
        assert publisher.prefix("wb.t", VALUE) == prefixes[-1]  # asked twice, sent once
        assert broker.sent == []
    assert prefixes[-1] == alone
    assert subjects(broker) == ["wb.t-key", "wb.u-key", "wb.t-value"]
    assert {topic for topic, _, _ in broker.sent} == {wire.schemas_topic("wb")}
    assert broker.polls == 1
    publisher.prefix("wb.t", VALUE)
    assert len(broker.sent) == 3  # cached once acknowledged


def test_a_schema_kafka_refused_is_not_taken_for_published():
    broker = Broker(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    publisher = SchemaPublisher(broker, "wb", None)
    with pytest.raises(KafkaException), publisher.together():
        publisher.prefix("wb.t", VALUE)
    broker.error = None
    publisher.prefix("wb.t", VALUE)
    assert subjects(broker) == ["wb.t-value", "wb.t-value"]


def test_nothing_asked_for_in_a_failed_block_is_sent_or_cached():
    broker = Broker()
    publisher = SchemaPublisher(broker, "wb", None)
    with pytest.raises(RuntimeError), publisher.together():
        publisher.prefix("wb.t", VALUE)
        raise RuntimeError("planning failed")
    assert broker.sent == []
    publisher.prefix("wb.t", VALUE)
    assert subjects(broker) == ["wb.t-value"]
