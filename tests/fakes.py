"""Stand-ins for the producer's Kafka shell, for tests of pure logic."""

from __future__ import annotations


class ListChannel:
    """A ``kafka_io.ReadChannel`` that keeps what is sent, as
    ``(writer, key, value, headers)``, and has nothing in flight."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, writer, key, value, headers) -> None:
        self.sent.append((writer, key, value, headers))

    def send_all(self, messages, headers, events) -> None:
        for writer, key, value, stat in messages:
            self.send(writer, key, value, headers)
            events[stat] += 1

    def in_flight(self) -> int:
        return 0
