"""What packtool may touch: folders it marked as its own, one build per OUT at a time, an OUT apart from its inputs.

    FOLDER/packtool-owned.json    {"packtool": "staging" | "token-cache", "version": 1}, written when packtool
                                  creates FOLDER (or finds it empty): packtool writes into and deletes from a
                                  staging or cache folder only when this marker is there
    FOLDER/packtool.lock          flock'ed while a build (or `cache clear`) uses FOLDER; an exclusive holder
                                  writes its pid in it. The kernel drops the lock when the process dies, so a
                                  killed build never leaves a stale lock behind.

A path that is a symbolic link is never taken for packtool's folder: removing "its" files would remove
the files the link points to.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packtool.config import BuildConfig
from packtool.errors import OwnershipError

MARKER = "packtool-owned.json"
LOCK = "packtool.lock"
MARKER_VERSION = 1
# Paths a build writes inside OUT (and inside its overflow/ and validation/ folders).
WRITES_IN_OUTPUT = ("manifest.json", "rejects.jsonl", "README.md", "shard-00000.parquet")
SUBFOLDERS = ("overflow", "validation")
_MAGIC = re.compile(r"[*?[]")  # what makes a path segment a glob


def claim(folder: Path, kind: str) -> None:
    """Make sure `folder` is packtool's `kind` folder: create it marked, mark it when empty, else check its marker."""
    if folder.is_symlink():
        raise OwnershipError(
            f"{folder} is a symbolic link; packtool writes its {kind} folder only as a real folder it created "
            "(it would write and delete through the link): remove the link or choose another path"
        )
    if folder.exists():
        if not folder.is_dir():
            raise OwnershipError(f"{folder} is a file, not a packtool {kind} folder; move it or choose another path")
        if is_marked(folder, kind):
            return
        if any(entry.name != LOCK for entry in folder.iterdir()):
            raise OwnershipError(
                f"{folder} exists and is not a packtool {kind} folder (no {MARKER} in it); packtool will not write "
                "into or delete from it: move it away (or delete it if it is an older packtool's), or choose "
                "another path"
            )
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / MARKER
    temporary = fresh_temporary(marker)
    try:
        temporary.write_text(json.dumps({"packtool": kind, "version": MARKER_VERSION}) + "\n", encoding="utf-8")
        os.replace(temporary, marker)
    finally:
        temporary.unlink(missing_ok=True)


def fresh_temporary(final: Path) -> Path:
    """A temporary name beside `final`, unique to this writer (hidden, so globs over the folder skip it)."""
    return final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")


def is_marked(folder: Path, kind: str) -> bool:
    marker = folder / MARKER
    if folder.is_symlink() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        mark = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("packtool") == kind


@contextmanager
def locked(folder: Path, what: str, *, shared: bool = False) -> Iterator[None]:
    """Hold `folder`'s lock: exclusive (one holder, its pid written) or shared (builds sharing a cache).

    A conflicting holder means one line naming it, never a wait that could hang a scheduled job. The
    folder may be removed by the holder as it finishes (a published staging folder): the lock taken is
    then on a file no longer at the path, so it is taken again on the new one.
    """
    path = folder / LOCK
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:  # a link at the lock's path (ELOOP), a folder packtool cannot write
            raise OwnershipError(
                f"{path}: {exc.strerror}; cannot lock {what}; remove it or fix its permissions"
            ) from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise OwnershipError(f"{what} is in use by {_holder(path)} (lock {path}); wait for it to finish") from None
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        if current is None or current.st_ino != os.fstat(fd).st_ino:
            os.close(fd)
            folder.mkdir(parents=True, exist_ok=True)
            continue
        break
    else:
        raise OwnershipError(f"{path}: the lock file keeps being replaced; is another tool removing {folder}?")
    try:
        if not shared:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(path: Path) -> str:
    try:
        pid = path.read_text(encoding="utf-8").strip()
    except OSError:
        pid = ""
    return f"packtool process {pid}" if pid.isdigit() else "a running packtool build"


def unlinked(path: Path) -> Path:
    """An absolute path with its folders resolved but its last name kept (a link there stays a link)."""
    absolute = Path(os.path.abspath(path))
    return absolute.parent.resolve() / absolute.name


def check_apart(config: BuildConfig, output: Path, cache: Path | None) -> None:
    """Refuse an OUT that holds or overlaps what the build reads (inputs, tokenizer, template, config) or its cache.

    A build replaces OUT whole, so anything inside it would be lost; an OUT inside a folder whose glob
    would match its shards would feed the build its own output next time.
    """
    if not output.name:
        raise OwnershipError(f"output {output} is a filesystem root; choose a folder for the build")
    read = [Path(f) for s in config.sources for f in s.paths]
    read += [Path(config.tokenizer.path)] + (
        [Path(config.tokenizer.config_path)] if config.tokenizer.config_path else []
    )
    read += [Path(config.template)] if config.template.endswith(".jinja") else []
    read += [Path(config.config_file)] if Path(config.config_file).is_file() else []
    for path in read:
        resolved = path.resolve()
        if resolved == output or resolved.is_relative_to(output):
            raise OwnershipError(
                f"output {output} holds {resolved}, which the build reads; a build replaces OUT whole, so choose "
                "an output folder apart from the inputs, tokenizer, template and config"
            )
    base = Path(config.config_file).resolve().parent if Path(config.config_file).is_file() else None
    for source in config.sources:
        for pattern in source.patterns:
            _check_pattern(output, pattern, base, source.name)
    if cache is not None:
        cache = cache.resolve()  # where a link would lead: a link into OUT is refused here, a link anywhere by claim
        if cache == output or cache.is_relative_to(output) or output.is_relative_to(cache):
            raise OwnershipError(
                f"output {output} and cache {cache} overlap; a build replaces OUT whole and the cache holds "
                "entries packtool reuses: give them separate folders (e.g. --cache beside OUT)"
            )


def _check_pattern(output: Path, pattern: str, base: Path | None, source: str) -> None:
    written = Path(pattern).expanduser()
    if not written.is_absolute():
        if base is None:
            return  # a config given as a dict: its inputs are checked as the files they resolved to
        written = base / written
    parts = written.parts
    magic = next((i for i, part in enumerate(parts) if _MAGIC.search(part)), None)
    root = Path(*parts[:magic]).resolve() if magic is not None else written.resolve()
    if root == output or root.is_relative_to(output):
        raise OwnershipError(
            f"output {output} holds input {pattern!r} of source {source!r}; a build replaces OUT whole, so choose "
            "an output folder apart from the inputs"
        )
    if not output.is_relative_to(root):
        return
    if magic is None:  # a folder input (a saved dataset): everything in it is input
        if root.is_dir():
            raise OwnershipError(
                f"output {output} is inside input folder {root} of source {source!r}; choose an output folder "
                "outside it"
            )
        return
    pattern_parts = [*root.parts, *parts[magic:]]
    for sub in ("", *SUBFOLDERS):
        for name in WRITES_IN_OUTPUT:
            if _glob_matches(pattern_parts, (output / sub / name).parts):
                raise OwnershipError(
                    f"input {pattern!r} of source {source!r} would read {output / sub / name} as input on the next "
                    "build; choose an output folder its glob does not match"
                )


def _glob_matches(pattern: list[str], path: tuple[str, ...]) -> bool:
    """Segment by segment, as `glob(recursive=True)` matches: `**` is zero or more folders, `*` stays in one."""
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_glob_matches(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and _glob_matches(pattern[1:], path[1:])
