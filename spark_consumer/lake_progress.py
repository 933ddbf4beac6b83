"""A lakehouse table's own record of what is applied, written in the
metadata of the commit that applies it (Delta: the commit's ``userMetadata``)
and read back at every start. Pure: no Spark, no storage; ``walbridge
reconcile`` reads it too.

The record, JSON: ``{"walbridge": {"group", "topic", "partitions": {p:
[next_offset, applied_lsn, applied_op_index, floor_lsn, floor_op_index,
topic_id]}, "backfills": {id: [start_lsn, partitions, [partitions done],
complete]}, "commits": n}}`` (``commits``: how many batches the table
has committed; the keyless pending removals' commits carry it too).

Invariants:
- A record names its consumer group; another group's record is not read as ours.
- A backfill completes once, when its ``backfill_end`` has been applied on
  all its partitions (:func:`backfill_ends_applied`); the batch that completes
  it also removes what it did not rewrite. A replayed end of a complete
  backfill completes nothing again.
- Complete backfills are kept (the newest :data:`KEEP_COMPLETE`) so that
  ``reconcile`` can tell one was applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from spark_consumer.apply_plan import Cut
from spark_consumer.progress import Progress

METADATA_KEY = "walbridge"
KEEP_COMPLETE = 32


@dataclass
class LakeProgress:
    """One table's record (module docstring)."""

    topic: str
    partitions: dict[int, Progress] = field(default_factory=dict)
    backfills: dict[str, list] = field(default_factory=dict)  # id -> [start lsn, partitions, done, complete]
    commits: int = 0

    def to_json(self, group: str) -> str:
        parts = {str(p): [pr.next_offset, *(pr.applied or (None, None)), *(pr.floor or (None, None)), pr.topic_id]
                 for p, pr in sorted(self.partitions.items())}
        return json.dumps({METADATA_KEY: {"group": group, "topic": self.topic, "partitions": parts,
                                          "backfills": self.backfills,
                                          "commits": self.commits}}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | None, group: str) -> LakeProgress | None:
        """The group's record in a commit's metadata, or None."""
        try:
            meta = json.loads(text or "")[METADATA_KEY]
        except (ValueError, TypeError, KeyError):
            return None
        if not isinstance(meta, dict) or meta.get("group") != group:
            return None
        partitions = {int(p): Progress(nxt, (alsn, aopi) if alsn is not None else None,
                                       (flsn, fopi) if flsn is not None else None, topic_id)
                      for p, (nxt, alsn, aopi, flsn, fopi, topic_id) in meta["partitions"].items()}
        return cls(meta["topic"], partitions, {k: list(v) for k, v in (meta.get("backfills") or {}).items()},
                   int(meta.get("commits") or 0))

    def complete(self, backfill_id: str) -> bool:
        entry = self.backfills.get(backfill_id)
        return bool(entry and entry[3])


def backfill_ends_applied(backfills: Mapping[str, list], ends: Iterable[Cut]) -> tuple[dict[str, list], list[int]]:
    """The backfills after a batch's ``backfill_end`` rows, and the start LSNs
    of those the batch completes (their collection runs in the batch's commit)."""
    out = {k: list(v) for k, v in backfills.items()}
    completed = []
    for cut in ends:
        info = cut.info or {}
        bid = str(info["backfill_id"])
        entry = out.setdefault(bid, [int(info["lsn"]), int(info["partitions"]), [], False])
        if cut.partition not in entry[2]:
            entry[2].append(cut.partition)
        if not entry[3] and len(entry[2]) >= entry[1]:
            entry[3] = True
            completed.append(entry[0])
    done = sorted((e[0], k) for k, e in out.items() if e[3])
    for _, k in done[:-KEEP_COMPLETE]:
        del out[k]
    return out, completed
