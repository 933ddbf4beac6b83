"""Which equal row each removal of a keyless shape takes (pure).

A keyless shape's table is a multiset: equal rows are interchangeable by
content but not by position, and positions decide what a cut or a completed
backfill collects later. So a removal takes the *newest* equal row older than
itself: when a backfill re-read the table at ``S`` and the removal came after
``S``, the row it removes is the re-read copy, not the copy from before ``S``
that the backfill's end collects anyway.

A removal that found only a copy older than a backfill's start (the re-read
copy had not arrived yet) remembers what it took (its *took* rank). A re-read
row at ``S`` that arrives later, with ``took < S < removal``, is the copy the
removal should have taken: the removal takes it instead (it is not applied),
and its took rank moves up to ``S``.

Invariants (:func:`pair`):
- Takers go oldest first; each takes the newest still-free candidate of its
  content that ranks below it and, for a remembered take, above its took rank
  and among re-read (snapshot) rows only.
- A candidate is taken at most once; a taker takes at most one candidate.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

Rank = tuple  # (lsn, op_index, streamed): at equal positions a streamed change is the newer


@dataclass(frozen=True)
class Taker:
    id: Any
    content: Hashable
    rank: Rank
    took: Rank | None = None  # set: an earlier take, which only a newer re-read copy may replace


@dataclass(frozen=True)
class Candidate:
    id: Any
    content: Hashable
    rank: Rank
    order: tuple = ()  # tie-break among equal ranks (partition, offset)
    reread: bool = False  # a snapshot or backfill row


def pair(takers: Iterable[Taker], candidates: Iterable[Candidate]) -> dict[Any, Candidate]:
    """Taker id -> the candidate it takes (module invariants)."""
    free: dict[Hashable, list[tuple[tuple, Candidate]]] = {}
    for c in candidates:
        free.setdefault(c.content, []).append(((c.rank, c.order), c))
    for row in free.values():
        row.sort(key=lambda e: e[0])
    taken: dict[Any, Candidate] = {}
    for t in sorted(takers, key=lambda t: t.rank):
        row = free.get(t.content)
        if not row:
            continue
        i = bisect.bisect_left(row, t.rank, key=lambda e: e[0][0]) - 1  # the newest below it
        while i >= 0:
            c = row[i][1]
            if t.took is not None and c.rank <= t.took:
                break
            if t.took is None or c.reread:
                taken[t.id] = c
                del row[i]
                break
            i -= 1
    return taken
