"""The interface every target implements (:class:`Target`) and the batch it
is handed (:class:`ShapeBatch`); what they promise: :mod:`spark_consumer.targets`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from spark_consumer.batch import BatchResult, Part
from spark_consumer.progress import Progress
from spark_consumer.shape_record import ShapeTarget


@dataclass(frozen=True)
class ShapeBatch:
    """One shape's part of a micro-batch: its topic, the target its rows were
    decoded for, its parts (one per topic-partition), and whether its table
    must follow that target first (a new writer schema)."""

    topic: str
    target: ShapeTarget
    parts: Sequence[Part]
    follow: bool = False


class Target(Protocol):
    """What the consumer's query needs of a target (module docstring)."""

    address: str  # for logs and errors

    def follow(self, topic: str, target: ShapeTarget) -> None:
        """Make the shape's table (create it, or change it to) follow ``target``."""

    def read_progress(self, group: str) -> dict[tuple[str, int], Progress]:
        """The group's progress per (topic, partition), as last committed."""

    def apply(self, group: str, batches: Sequence[ShapeBatch], *, on_offset_reset: str,
              hold: Callable[[str, str], None]) -> BatchResult:
        """Apply one micro-batch, each shape's progress in its rows' commit;
        ``hold(topic, why)`` for a shape whose table cannot follow (its rows
        are left out, its progress stays)."""

    def close(self) -> None:
        """Release connections (the query has stopped)."""
