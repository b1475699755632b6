"""Staging and publish: OUT always holds one complete build, the previous one or the new one.

    OUT/                               the last complete build (untouched until the new one is whole)
    .OUT.packtool-staging/             sibling of OUT (same filesystem, so the swap is a rename)
        plan-KEY/                      the plan (plan.json last)
        out-KEY/                       the new build, shard by shard; manifest.json last
        done-KEY/                      one small file per finished shard (emit resumes from these)
        cache/                         the token store of a --no-cache build (removed with the folder)
        previous/                      the old OUT for the instant of the swap (where no exchange exists)

Publishing exchanges out-KEY/ and OUT in one atomic rename (Linux `renameat2(RENAME_EXCHANGE)`),
so OUT is never missing, even for a build killed mid-publish. Where the system cannot exchange
(another OS, a filesystem without it), OUT is renamed to previous/ and out-KEY/ to OUT: a crash
between the two renames leaves previous/ complete, and the next build puts it back first.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packtool.errors import PacktoolError
from packtool.format import MANIFEST, REJECTS

# What a packtool build (this one or an older layout) writes into OUT; anything else is the user's.
OUTPUT_ENTRIES = (MANIFEST, REJECTS, "shard-*.parquet", "overflow", "validation", ".packtool-work", "*.tmp*")


@dataclass(frozen=True)
class Staging:
    output: Path

    @property
    def root(self) -> Path:
        return self.output.parent / f".{self.output.name}.packtool-staging"

    def plan(self, key: str) -> Path:
        return self.root / f"plan-{key}"

    def out(self, key: str) -> Path:
        return self.root / f"out-{key}"

    def done(self, key: str) -> Path:
        return self.root / f"done-{key}"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def previous(self) -> Path:
        return self.root / "previous"

    def prepare(self) -> None:
        """Put back an old build a crash left mid-swap, refuse an OUT holding other files, create the folder."""
        if not self.output.exists() and (self.previous / MANIFEST).is_file():
            os.replace(self.previous, self.output)
        if self.output.exists() and not self.output.is_dir():
            raise PacktoolError(f"output {self.output} is a file; choose a folder")
        check_replaceable(self.output)
        self.root.mkdir(parents=True, exist_ok=True)

    def keep_only(self, key: str) -> None:
        """Remove what earlier builds with another plan left here (their shards are not this build's).

        out-KEY is resumed only beside its done-KEY markers: without them it holds no finished shard,
        or it is what a build killed while publishing left (see `publish`).
        """
        keep = {"cache", f"plan-{key}", f"done-{key}"} | ({f"out-{key}"} if self.done(key).is_dir() else set())
        for entry in self.root.iterdir():
            if entry.name in keep:
                continue
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def publish(self, key: str, swapped: Callable[[], None] = lambda: None) -> None:
        """Put out-KEY/ in OUT's place; `swapped` runs once the new build is in OUT (tests stop there)."""
        new = self.out(key)
        if (new / MANIFEST).is_file() is False:
            raise RuntimeError(f"{new} has no {MANIFEST}: publish called before the build finished")
        check_replaceable(self.output)
        shutil.rmtree(self.previous, ignore_errors=True)
        # The markers go first: after the exchange out-KEY holds the old build, never to be resumed.
        shutil.rmtree(self.done(key), ignore_errors=True)
        if not self.output.exists():
            os.replace(new, self.output)
        elif not exchange(new, self.output):
            os.replace(self.output, self.previous)
            os.replace(new, self.output)
        swapped()
        shutil.rmtree(self.root, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def check_replaceable(output: Path) -> None:
    """OUT may be replaced when it is missing, empty, or holds only what packtool writes."""
    if not output.is_dir():
        return
    for entry in sorted(output.iterdir()):
        if not any(fnmatch.fnmatch(entry.name, pattern) for pattern in OUTPUT_ENTRIES):
            raise PacktoolError(
                f"output {output} holds {entry.name!r}, which packtool did not write; a build replaces the whole "
                "folder, so choose an empty or new output folder"
            )


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; False where the system offers no such rename."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # kernel or filesystem without RENAME_EXCHANGE
        return False
    raise OSError(code, os.strerror(code), str(b))
