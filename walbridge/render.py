"""Everything walbridge shows with rich: ``up``'s live view, ``status``,
``verify`` and ``reconcile``.

Invariants:
- Pure: each function turns plain data (a view snapshot dict, a status dict,
  ``ShapeDiff`` lists) into rich renderables or strings; nothing here reads a
  database, a broker or the clock, so what is shown can be tested against the
  numbers it was given.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from walbridge.verify import ShapeDiff

KEYS_LISTED = 10  # differing keys listed per shape and kind under the verify table


def render_view(snap: dict):
    head = Table.grid(padding=(0, 2))
    slot = snap.get("slot") or {}
    head.add_row("uptime", f"{snap['uptime_s']}s", "slot confirmed", str(slot.get("confirmed_flush_lsn") or "-"),
                 "retained WAL", human_bytes(slot.get("retained_wal_bytes")))
    head.add_row("workload tx", str(snap.get("workload_tx", 0)), "errors", str(snap.get("errors", 0)),
                 "DLQ", str(snap.get("dlq", 0)))
    if snap.get("stalled_groups"):
        head.add_row("STALLED", ", ".join(snap["stalled_groups"]), "", "", "", "")
    spark = snap.get("spark")
    if spark:
        head.add_row("spark batch", "-" if spark["batch"] is None else str(spark["batch"]),
                     "input rows/s", "-" if spark["rows_per_s"] is None else f"{spark['rows_per_s']:.1f}",
                     "batch duration", "-" if spark["batch_s"] is None else f"{spark['batch_s']:.2f}s")
        head.add_row("spark UI", spark.get("ui") or "off", "", "", "", "")
    shapes = Table(title="shapes")
    for col, justify in (("shape", "left"), ("events", "right"), ("events/s", "right"), ("lag", "right")):
        shapes.add_column(col, justify=justify)
    for s in snap["shapes"]:
        shapes.add_row(s["shape"], str(s["events"]), f"{s['events_per_s']:.1f}",
                       "-" if s["lag"] is None else str(s["lag"]))
    parts = [head, shapes]
    snapshot = snap.get("snapshot") or {}
    if snapshot:
        state = "done" if snapshot.get("done") else (
            f"{snapshot.get('rows_per_s', 0):.0f} rows/s, ETA {snapshot.get('eta_s', '?')}s")
        parts.append(f"snapshot {snapshot.get('id')}: {snapshot.get('rows', 0)} rows "
                     f"of ~{snapshot.get('total_estimate', 0)} ({state})")
    line = backfill_line(snap.get("backfill"), snap.get("backfills_queued", 0), snap.get("backfills_done", 0))
    if line:
        parts.append(line)
    writers = Table(title="writers")
    writers.add_column("topic[partition]")
    writers.add_column("produced", justify="right")
    writers.add_column("committed", justify="right")
    for w in snap["writers"]:
        writers.add_row(w["writer"], str(w["produced"]), "-" if w["committed"] is None else str(w["committed"]))
    parts.append(writers)
    return Group(*parts)


def backfill_line(running: dict | None, queued: int, done: int) -> str | None:
    """One line on backfills: the running one's rows, rate and ETA, and counts."""
    if running is None and not queued and not done:
        return None
    text = "backfills: "
    if running is not None:
        eta = running.get("eta_s")
        text += (f"{running['shape']} {running.get('rows', 0)} of ~{running.get('total_estimate', 0)} rows, "
                 f"{running.get('rows_per_s', 0):.0f} rows/s, ETA {'-' if eta is None else f'{eta:.0f}s'}"
                 f" ({running.get('state')}); ")
    return text + f"{queued} queued, {done} done"


def render_status(status: dict):
    parts = []
    slot = status["slot"]
    t = Table(title="replication slot", show_header=False)
    if slot is None:
        t.add_row("slot", "not created yet")
    else:
        t.add_row("slot", f"{slot['name']} ({'active' if slot['active'] else 'inactive'})")
        t.add_row("confirmed_flush_lsn", slot["confirmed_flush_lsn"] or "-")
        t.add_row("current WAL", slot["current_wal_lsn"])
        t.add_row("retained WAL", human_bytes(slot["retained_wal_bytes"]))
    parts.append(t)
    w = Table(title="writers (topic-partitions)")
    w.add_column("writer")
    w.add_column("produced", justify="right")
    for g in status["groups"]:
        w.add_column(f"committed by {g}", justify="right")
    w.add_column("lag", justify="right")
    w.add_column("stalled")
    for row in status["writers"]:
        w.add_row(row["writer"], str(row["produced"]), *[str(row["committed"].get(g, 0)) for g in status["groups"]],
                  str(row["lag"]), "STALLED" if row["stalled"] else "")
    parts.append(w)
    p = status["producer"]
    pt = Table(title="producer", show_header=False)
    if p is None:
        pt.add_row("state", "no status published (not running yet?)")
    else:
        pt.add_row("last report", f"{p['age_s']}s ago")
        pt.add_row("confirmed LSN (sent)", p.get("confirmed_lsn") or "-")
        pt.add_row("waiting for groups", ", ".join(p.get("ack_groups") or []) or "(broker acks)")
        pt.add_row("stalled groups", ", ".join(p.get("stalled_groups") or []) or "none")
        for shape, stop in (p.get("stopped_shapes") or {}).items():
            pt.add_row(f"STOPPED {shape}", stop["error"] + (f" (WAL held from {stop['held_lsn']})"
                                                             if stop.get("wal_held") else ""))
        snap = p.get("snapshot") or {}
        if snap:
            pt.add_row("snapshot", f"{snap.get('id')}: {snap.get('rows')} rows"
                       + (" (done)" if snap.get("done") else f" of ~{snap.get('total_estimate')}"))
    parts.append(pt)
    running = (p or {}).get("backfill")
    line = backfill_line(running, len((p or {}).get("backfills_queued") or []),
                         len((p or {}).get("backfills_done") or []))
    if status.get("backfills") or line:
        bt = Table(title="backfills" + (f" — {line}" if line else ""))
        for col in ("request", "shape", "scope", "state", "rows", "applied by the consumer"):
            bt.add_column(col)
        for r in status.get("backfills") or []:
            scope = r.get("scope")
            applied = r.get("applied")
            bt.add_row(r["request_id"], r["shape"],
                       f"{len(scope['buckets'])}/{scope['bucket_count']} buckets" if scope else "whole shape",
                       r["state"], str(r.get("rows", "-")),
                       "-" if not applied else ("complete, GC deleted " + str(applied["gc_deleted"])
                                                if applied["completed"] else
                                                f"{applied['partitions_done']}/{applied['partitions']} partitions"))
        parts.append(bt)
    return Group(*parts)


def render_verify(diffs: list[ShapeDiff]):
    t = Table(title="walbridge verify")
    for col in ("shape", "source", "target", "buckets≠", "missing", "extra", "changed", "result"):
        t.add_column(col, justify="left" if col in ("shape", "result") else "right", no_wrap=col == "result")
    for d in diffs:
        result = "OK" if d.ok else (d.error or "DIFFERENT")
        t.add_row(d.shape, str(d.source_rows), str(d.target_rows), f"{d.differing_buckets}/{d.buckets}",
                  str(len(d.missing)), str(len(d.extra)), str(len(d.changed)), result)
    return t


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def verify_details(diffs: list[ShapeDiff]) -> list[str]:
    """One line per shape and kind of difference, listing the first keys."""
    lines = []
    for d in diffs:
        for label, keys in (("missing in target", d.missing), ("extra in target", d.extra),
                            ("different", d.changed)):
            if keys:
                shown = ", ".join(map(str, keys[:KEYS_LISTED])) + (" ..." if len(keys) > KEYS_LISTED else "")
                lines.append(f"{d.shape}: {len(keys)} key(s) {label}: {shown}")
    return lines
