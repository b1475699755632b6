"""Staging and publish: OUT always holds one complete build, the previous one or the new one.

    OUT/                               the last complete build (untouched until the new one is whole)
    .OUT.packtool-staging/             sibling of OUT (same filesystem, so the swap is a rename)
        packtool-owned.json            marks the folder as packtool's (builder.owned): nothing else is written to
        packtool.lock                  flock'ed by the one build of OUT that runs (its pid inside)
        plan-KEY/                      the plan (plan.json last)
        out-KEY/                       the new build, shard by shard; manifest.json last
        done-KEY/                      one small file per finished shard (emit resumes from these)
        cache/                         the token store of a --no-cache build (removed with the folder)
        previous/                      the old OUT for the instant of the swap (where no exchange exists)
        carry.json                     the user's entries being moved from OUT into out-KEY (see `publish`)

Publishing exchanges out-KEY/ and OUT in one atomic rename (Linux `renameat2(RENAME_EXCHANGE)`),
so OUT is never missing, even for a build killed mid-publish. Where the system cannot exchange
(another OS, a filesystem without it), OUT is renamed to previous/ and out-KEY/ to OUT: a crash
between the two renames leaves previous/ complete, and the next build puts it back first.

OUT is missing, empty, or an earlier build (a valid sealed manifest.json); any other folder is
refused. packtool owns in OUT only what its sealed manifest lists (and the manifest, rejects.jsonl,
and the same in overflow/ and validation/). Everything else in OUT is the user's (a report, notes,
an eval set, a folder): it is moved into the new build before the swap, so it survives the rebuild.
A user's file named like packtool's output (a .parquet, a manifest, a temporary) would be taken for
part of the build by its readers, so OUT is refused, naming it, before any work.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packtool.builder.owned import LOCK, MARKER, SUBFOLDERS, claim, locked
from packtool.errors import OwnershipError, PacktoolError
from packtool.format import (
    CARD,
    MANIFEST,
    PROCESSOR_FOLDER,
    REJECTS,
    is_plain_name,
    read_manifest,
    sha256_file,
    write_json_atomic,
)
from packtool.seal import SEAL, manifest_digest

STAGING_KIND = "staging"
CARRY = "carry.json"
# Names that readers of OUT (verify, the loader, stats, `datasets` and the Hub: the card) take for part of the build.
LOOKS_BUILT = (MANIFEST, REJECTS, CARD, "*.parquet", "*.tmp*")


def holds_build(output: Path, plan_key: str, config_hash: str) -> dict | None:
    """OUT's manifest when OUT already holds the build of this plan (whose key hashes packtool's code, its
    version included) and config, with every shard's bytes as its manifest records them (sha256) in OUT
    and its parts; else None.

    The build is deterministic, so its bytes would be these again: a rerun keeps them instead of writing
    and swapping in a copy. Anything read back is checked first (the manifest's seal, each shard's hash).
    """
    try:
        manifest = read_manifest(output)
        raw = manifest.raw
        if (raw.get("plan_hash"), raw.get("config_hash")) != (plan_key, config_hash):
            return None
        for folder in [output, *(output / name for name in manifest.parts.values())]:
            listed = manifest if folder == output else read_manifest(folder)
            if not listed.sealed or any(sha256_file(entry.file) != entry.sha256 for entry in listed.shards):
                return None
            if not _card_is_ours(folder, listed.raw.get("card")):
                return None
            with (folder / REJECTS).open("rb") as rejects:
                if sum(1 for _ in rejects) != listed.raw["rejects"]["count"]:
                    return None
    except (PacktoolError, OSError, KeyError, TypeError):
        return None
    return raw


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

    @contextmanager
    def held(self) -> Iterator[None]:
        """Claim the staging folder (refusing a link or a folder packtool did not mark) and hold OUT's lock."""
        claim(self.root, STAGING_KIND)
        with locked(self.root, f"output {self.output}"):
            claim(self.root, STAGING_KIND)  # the holder before us may have removed it as it published
            try:
                yield
            finally:
                self.tidy()

    def prepare(self) -> None:
        """Put back what a crash left mid-publish, then refuse an OUT packtool cannot rebuild safely."""
        if not self.output.exists() and (self.previous / MANIFEST).is_file():
            os.replace(self.previous, self.output)
        self._carry_back()
        if self.output.is_symlink() or (self.output.exists() and not self.output.is_dir()):
            raise OwnershipError(f"output {self.output} is not a folder; choose a folder")
        if self.output.is_dir() and _sealed_manifest(self.output / MANIFEST) is None and any(self.output.iterdir()):
            listed = ", ".join(repr(name) for name in sorted(os.listdir(self.output))[:5])
            raise OwnershipError(
                f"output {self.output} holds {listed}, and no packtool build (no valid {MANIFEST}); packtool builds "
                "into an empty or new folder, or over its own earlier build: choose another output folder"
            )
        look_alikes = [name for name in user_entries(self.output) if looks_built(name)]
        if look_alikes:
            listed = ", ".join(repr(name) for name in look_alikes[:5])
            raise OwnershipError(
                f"output {self.output} holds {listed}, which packtool did not write (its manifest does not list it, "
                "or not as it is now) but which readers would take for part of the build; move or delete it, then rerun"
            )

    def clear_work(self) -> None:
        """Remove every earlier build's work from the staging folder (--no-cache), keeping the marker and lock."""
        self.keep_only(None)

    def keep_only(self, key: str | None) -> None:
        """Remove what earlier builds with another plan left here (their shards are not this build's).

        out-KEY is resumed only beside its done-KEY markers: without them it holds no finished shard,
        or it is what a build killed while publishing left (see `publish`). Only real folders are kept.
        """
        if not self.root.is_dir():
            return
        keep = {"cache"} if key is not None else set()
        if key is not None:
            keep |= {f"plan-{key}", f"done-{key}"} | ({f"out-{key}"} if self.done(key).is_dir() else set())
        for entry in self.root.iterdir():
            if entry.name in (MARKER, LOCK):
                continue
            if entry.name in keep and entry.is_dir() and not entry.is_symlink():
                continue
            _remove(entry)

    def forget(self, key: str) -> None:
        """Drop one plan's staged work (its plan failed its check: nothing made from it is trusted)."""
        for path in (self.plan(key), self.out(key), self.done(key)):
            if os.path.lexists(path):
                _remove(path)

    def publish(self, key: str, swapped: Callable[[], None] = lambda: None) -> None:
        """Put out-KEY/ in OUT's place, with the user's entries of OUT moved into it first.

        `swapped` runs once the new build is in OUT (tests stop there). carry.json names the entries
        being moved before any moves: a build killed before the swap has them put back into OUT by
        the next build (`prepare`); after the swap they are in the new OUT already.
        """
        new = self.out(key)
        if (new / MANIFEST).is_file() is False:
            raise RuntimeError(f"{new} has no {MANIFEST}: publish called before the build finished")
        for stray in user_entries(new):  # a temporary of a killed emit, or anything else the build did not list
            _remove(new / stray)
        carried = user_entries(self.output) if self.output.is_dir() else []
        clashes = [name for name in carried if os.path.lexists(new / name)]
        if clashes:
            raise OwnershipError(
                f"output {self.output} holds {clashes[0]!r}, which the new build also writes; move it away, then rerun"
            )
        shutil.rmtree(self.previous, ignore_errors=True)
        # The markers go first: after the exchange out-KEY holds the old build, never to be resumed.
        shutil.rmtree(self.done(key), ignore_errors=True)
        if carried:
            write_json_atomic(self.root / CARRY, {"out": new.name, "entries": carried})
            try:
                for name in carried:
                    (new / name).parent.mkdir(exist_ok=True)
                    os.rename(self.output / name, new / name)
            except OSError:
                self._carry_back()
                raise
        if not self.output.exists():
            os.replace(new, self.output)
        elif not exchange(new, self.output):
            os.replace(self.output, self.previous)
            os.replace(new, self.output)
        swapped()
        shutil.rmtree(self.root, ignore_errors=True)

    def _carry_back(self) -> None:
        """Return to OUT the user's entries a publish moved into out-KEY but did not swap in."""
        journal = self.root / CARRY
        if not journal.is_file():
            return
        try:
            carry = json.loads(journal.read_text(encoding="utf-8"))
            entries = [str(name) for name in carry["entries"]]
            moved_into = self.root / str(carry["out"])
        except (OSError, ValueError, KeyError, TypeError):
            raise OwnershipError(
                f"{journal} is unreadable: a publish was interrupted while moving your files from {self.output} "
                f"into {self.root}/out-*; move them back into {self.output}, delete {journal}, then rerun"
            ) from None
        for name in entries:
            moved, home = moved_into / name, self.output / name
            if os.path.lexists(moved) and not os.path.lexists(home):
                home.parent.mkdir(parents=True, exist_ok=True)
                os.rename(moved, home)
        journal.unlink()

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def tidy(self) -> None:
        """Remove the staging folder when it holds nothing but its marker and lock (a dry run, a refused build)."""
        if self.root.is_dir() and not self.root.is_symlink() and set(os.listdir(self.root)) <= {MARKER, LOCK}:
            shutil.rmtree(self.root, ignore_errors=True)


def built_entries(folder: Path) -> set[str]:
    """What packtool provably wrote in an output folder: the files its sealed manifests list, and those manifests.

    Paths are relative to `folder` ("validation/shard-00000.parquet"). A manifest that is missing,
    unreadable or does not match its seal proves nothing; nor does it for a listed shard of another size.
    """
    found: set[str] = set()
    for sub in ("", *SUBFOLDERS):
        manifest = _sealed_manifest(folder / sub / MANIFEST)
        if manifest is None:
            continue
        listed = [MANIFEST, manifest.get("rejects", {}).get("file", REJECTS)]
        # a listed shard is packtool's only while it has the size the manifest recorded (a file put in its
        # place is the user's); sizes, not hashes, so that looking at a large OUT costs nothing
        listed += [
            shard["file"]
            for shard in manifest.get("shards", [])
            if isinstance(shard, dict) and _size(folder / sub / str(shard.get("file", ""))) == shard.get("bytes")
        ]
        # the card is small and often edited by hand (on the Hub): packtool's only with the bytes it wrote
        card = manifest.get("card")
        listed += [card["file"]] if card is not None and _card_is_ours(folder / sub, card) else []
        # the image processor's files: packtool's while processor/ holds them alone, as recorded
        vision = manifest.get("vision")
        if vision is not None and _processor_is_ours(folder / sub, vision):
            listed += [f"{PROCESSOR_FOLDER}/{name}" for name in vision["processor"]["files"]]
        found |= {os.path.join(sub, name) if sub else name for name in listed if isinstance(name, str) and name}
    return found


def user_entries(folder: Path) -> list[str]:
    """The entries of an output folder packtool did not write, relative to it: moved whole when OUT is rebuilt.

    In overflow/ and validation/ (real folders), each entry is looked at on its own.
    """
    if not folder.is_dir() or folder.is_symlink():
        return []
    ours = built_entries(folder)
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name in SUBFOLDERS and entry.is_dir() and not entry.is_symlink():
            found += [
                f"{entry.name}/{inner.name}" for inner in sorted(entry.iterdir()) if not _is_ours(inner, folder, ours)
            ]
        elif not _is_ours(entry, folder, ours):
            found.append(entry.name)
    return found


def _is_ours(entry: Path, folder: Path, ours: set[str]) -> bool:
    """A file packtool wrote, or a folder of nothing else (processor/)."""
    if _rel(entry, folder) in ours:
        return True
    if not entry.is_dir() or entry.is_symlink():
        return False
    inside = list(entry.iterdir())
    return bool(inside) and all(_rel(inner, folder) in ours for inner in inside)


def _card_is_ours(folder: Path, card: object) -> bool:
    """True when the manifest records no card (an older build) or the card in `folder` has its recorded sha256."""
    if card is None:
        return True
    if not isinstance(card, dict) or not is_plain_name(card.get("file")):
        return False
    path = folder / card["file"]
    return path.is_file() and not path.is_symlink() and sha256_file(path) == card.get("sha256")


def _processor_is_ours(folder: Path, vision: object) -> bool:
    """True when folder/processor/ holds exactly the files the manifest's vision.processor lists, each with its
    recorded sha256 (a folder the user put there, or changed since, is the user's)."""
    processor = vision.get("processor") if isinstance(vision, dict) else None
    files = processor.get("files") if isinstance(processor, dict) else None
    path = folder / PROCESSOR_FOLDER
    if not isinstance(files, dict) or not path.is_dir() or path.is_symlink():
        return False
    if sorted(os.listdir(path)) != sorted(files):
        return False
    return all(
        is_plain_name(name) and not (path / name).is_symlink() and sha256_file(path / name) == digest
        for name, digest in files.items()
    )


def _size(path: Path) -> int | None:
    return path.lstat().st_size if path.is_file() and not path.is_symlink() else None


def _rel(path: Path, folder: Path) -> str:
    return str(path.relative_to(folder))


def looks_built(name: str) -> bool:
    """A name readers would take for part of a build (`push` asks it of a repo's files too)."""
    return any(fnmatch.fnmatch(Path(name).name, pattern) for pattern in LOOKS_BUILT)


def _sealed_manifest(path: Path) -> dict | None:
    if path.is_symlink() or not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get(SEAL) != manifest_digest(manifest):
        return None
    return manifest


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


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
