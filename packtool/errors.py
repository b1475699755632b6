"""Errors that reach the user as one line (the CLI turns them into exit code 1, no traceback)."""

from __future__ import annotations


class PacktoolError(Exception):
    """A problem the user can fix: bad config, bad input, a template that refuses a sample."""

    def __reduce__(self):
        # Errors cross process boundaries (build workers, Ray tasks). The default pickling calls
        # cls(*args), which fails for subclasses with required keyword-only fields; rebuilding
        # from args and the instance's fields works for every subclass.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[PacktoolError], args: tuple, fields: dict) -> PacktoolError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(fields)
    return error


def one_line(err: BaseException) -> str:
    """The first line of an exception's text (pyarrow's end in a newline; errors here are one line)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


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


class WorkerError(PacktoolError):
    """A worker process or Ray task was lost (killed, out of memory, a node gone), not the work item's own error."""


class ConfigError(PacktoolError):
    """A config with problems: all of them, each with its YAML path, in one message."""

    def __init__(self, path: str, problems: list[str]):
        self.problems = problems
        if len(problems) == 1:
            super().__init__(f"{path}: {problems[0]}")
            return
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{path}: {len(problems)} problems in config:\n{listing}")


class TemplateRaised(Exception):
    """A template called raise_exception: the template's own verdict on one sample (becomes a RecordError)."""


class PackFormatError(PacktoolError, ValueError):
    """A pack row or manifest breaks the shard contract (docs/format.md)."""


class DatasetError(PacktoolError):
    """The build folder cannot be read as promised by its manifest."""


class IsolationError(PacktoolError):
    """A model (with its attention backend and inputs) lets one packed document change another."""


class ProbeError(PacktoolError):
    """`packtool audit --probe` cannot find or build the model it was given."""


class BuildError(PacktoolError):
    """The build ran but its outcome must not be published (empty output, too many records lost)."""


class HubError(PacktoolError):
    """A name that is not in the local cache, or a folder that is not what it claims to be."""


class TraceError(PacktoolError):
    """A trace that cannot be answered: bad settings, a step outside the run, an unknown key."""


class OwnershipError(PacktoolError):
    """A path packtool was asked to write or delete is not provably its own; nothing was touched."""
