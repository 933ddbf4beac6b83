"""DeliveryLedger: transaction ends resolve to Kafka offsets, the latest per writer per round."""

from producer.kafka_io import DeliveryLedger

A, B = ("t", 0), ("t", 1)


class Msg:
    def __init__(self, writer, offset):
        self._w, self._o = writer, offset

    def topic(self):
        return self._w[0]

    def partition(self):
        return self._w[1]

    def offset(self):
        return self._o


def produce(ledger, writer, n=1):
    for _ in range(n):
        ledger.count_produce(writer)


def test_end_resolves_when_its_last_message_is_delivered():
    ledger = DeliveryLedger()
    produce(ledger, A, 2)
    ledger.end_transaction(A, "tx1")
    ledger.on_delivery(None, Msg(A, 10))
    assert ledger.take_boundaries() == []
    ledger.on_delivery(None, Msg(A, 11))
    assert ledger.take_boundaries() == [(A, 11, "tx1")]
    assert ledger.take_boundaries() == []
    assert ledger.in_flight() == 0


def test_already_delivered_transaction_resolves_at_once():
    ledger = DeliveryLedger()
    produce(ledger, A)
    ledger.on_delivery(None, Msg(A, 5))
    ledger.end_transaction(A, "tx1")
    assert ledger.take_boundaries() == [(A, 5, "tx1")]


def test_latest_end_per_writer_per_round():
    ledger = DeliveryLedger()
    for tx in ("tx1", "tx2", "tx3"):
        produce(ledger, A)
        ledger.end_transaction(A, tx)
    produce(ledger, B)
    ledger.end_transaction(B, "tx3")
    for offset in (0, 1):
        ledger.on_delivery(None, Msg(A, offset))
    ledger.on_delivery(None, Msg(B, 7))
    assert sorted(ledger.take_boundaries()) == [(A, 1, "tx2"), (B, 7, "tx3")]
    ledger.on_delivery(None, Msg(A, 2))
    assert ledger.take_boundaries() == [(A, 2, "tx3")]


def test_delivery_error_is_kept():
    class Err:
        def str(self):
            return "boom"

    ledger = DeliveryLedger()
    produce(ledger, A)
    ledger.on_delivery(Err(), Msg(A, -1))
    assert ledger.error is not None and "boom" in ledger.error_message
