"""Errors that reach the user as one line (the CLI turns them into exit code 1, no traceback)."""

from __future__ import annotations


class PacktoolError(Exception):
    """A problem the user can fix: bad config, bad input, a template that refuses a sample."""


class RecordError(PacktoolError):
    """One input record cannot be used. Carries where it came from so the message names file, row and field."""

    def __init__(
        self,
        reason: str,
        *,
        kind: str = "bad_record",
        file: str = "",
        row: int | None = None,
        field: str = "",
        sample_id: str = "",
    ):
        self.reason = reason
        self.kind = kind  # the short key rejects and stats count under
        self.file = file
        self.row = row
        self.field = field
        self.sample_id = sample_id
        super().__init__(reason)

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        where = []
        if self.file:
            where.append(self.file if self.row is None else f"{self.file}:{self.row}")
        elif self.sample_id:
            where.append(f"sample {self.sample_id!r}")
        if self.field:
            where.append(f"field '{self.field}'")
        prefix = ", ".join(where)
        return f"{prefix}: {self.reason}" if prefix else self.reason


class DatasetError(PacktoolError):
    """A build folder cannot be read as its manifest promises (missing, altered or out-of-folder shards, bad state)."""


class PackFormatError(PacktoolError, ValueError):
    """A pack breaks the shard contract of docs/format.md (offsets, labels at segment starts, lengths)."""
