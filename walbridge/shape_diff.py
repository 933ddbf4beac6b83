"""What ``walbridge verify`` found for one shape (:class:`ShapeDiff`), whatever the target."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ShapeDiff:
    shape: str
    source_table: str
    target_table: str
    source_rows: int = 0
    target_rows: int = 0
    buckets: int = 0
    differing_buckets: int = 0
    keyed: bool = True
    bucket_columns: list = field(default_factory=list)  # what a bucket hashes (schemas.buckets)
    differing: list = field(default_factory=list)  # the differing bucket numbers
    missing: list = field(default_factory=list)  # keys at the source, not in the target
    extra: list = field(default_factory=list)  # keys in the target, not at the source
    changed: list = field(default_factory=list)  # keys whose rows differ
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not (self.missing or self.extra or self.changed) \
            and self.source_rows == self.target_rows and self.differing_buckets == 0
