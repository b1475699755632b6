"""`packtool verify` of a build with images (docs/format.md "Images"): what the image columns promise, re-derived.

manifest vision           OUT/processor/ holds exactly the files vision.processor.files lists, each with its
                          sha256; the image columns are in every shard of a vision build and in no other's
per pack row              one entry per image in every image column (3 grid and 2 span values); spans inside
                          their document, in order, end - start = t * h * w / merge**2, every span token the
                          image token and never a label, no image token outside a span; mrope_positions
                          recomputed from the grids (each document's own, from 0)
per image                 embedded bytes hash as recorded (size and sha256); a referenced file under
                          vision.root hashes as recorded (a missing or changed one is a problem naming it),
                          each file read once; `images: embed` holds every image's bytes
per folder                vision.n_images and n_image_tokens are what the shards hold
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packtool.errors import PacktoolError
from packtool.format import IGNORE_INDEX, IMAGE_FIELDS, MANIFEST, MROPE_FIELD, PROCESSOR_FOLDER, Manifest, sha256_file
from packtool.vision.positions import document_positions
from packtool.vision.processors import QwenVLProcessor, load_processor

IMAGE_COLUMNS = [f.name for f in IMAGE_FIELDS]


@dataclass
class ImageCheck:
    """What one folder's rows are checked against, and what they held (for the manifest's counts)."""

    token: int | None  # vision.image_token_id
    merge_size: int | None  # the mRoPE families': positions are stored
    embed: bool
    root: Path
    files: dict[str, str | None] = field(default_factory=dict)  # reference -> its file's sha256 (None: unreadable)
    images: int = 0
    image_tokens: int = 0
    embedded: int = 0  # images whose stored bytes were hashed


@dataclass
class ImagesChecked:
    """What verify's image checks read, over every folder of an output (main, overflow, validation): its OK
    line says it. Each folder's check fills in as its rows are read."""

    checks: list[ImageCheck] = field(default_factory=list)

    @property
    def files(self) -> int:
        """Referenced files hashed, each once whichever folders' shards name it."""
        return len({check.root / reference for check in self.checks for reference in check.files})

    @property
    def embedded(self) -> int:
        return sum(check.embedded for check in self.checks)

    def as_dict(self) -> dict[str, int]:
        return {"files": self.files, "embedded": self.embedded}

    def describe(self) -> str:
        return f"images checked: {self.files} file(s), {self.embedded} embedded"


def image_check(folder: Path, manifest: Manifest) -> tuple[ImageCheck | None, list[str]]:
    """The check for a folder's rows (None: a build without images), and the problems of its processor files."""
    vision = manifest.vision
    if vision is None:
        return None, []
    copied = folder / PROCESSOR_FOLDER
    problems = []
    listed = vision["processor"]["files"]
    present = sorted(p.name for p in copied.iterdir()) if copied.is_dir() else []
    for name in sorted(set(present) - set(listed)):
        problems.append(f"{copied / name}: not listed in the manifest's vision.processor.files")
    for name, digest in sorted(listed.items()):
        if name not in present:
            problems.append(f"{copied / name}: missing (the manifest's vision.processor.files lists it)")
        elif sha256_file(copied / name) != digest:
            problems.append(f"{copied / name}: sha256 differs from the manifest (changed after the build)")
    merge_size = None
    if not problems:
        try:
            processor = load_processor(copied)
        except PacktoolError as error:
            problems.append(f"{copied}: {error}")
        else:
            merge_size = processor.merge_size if isinstance(processor, QwenVLProcessor) else None
    check = ImageCheck(vision["image_token_id"], merge_size, vision["images"] == "embed", Path(vision["root"]))
    return (None if problems else check), problems


def schema_problems(columns: list[str], check: ImageCheck | None) -> list[str]:
    """A shard's image columns against its manifest: all of them in a vision build, none in another."""
    has_images = all(name in columns for name in IMAGE_COLUMNS)
    if check is None:
        return ["image columns, but the manifest records no vision build"] if has_images else []
    problems = [] if has_images else [f"no image columns ({', '.join(IMAGE_COLUMNS)}) in a vision build"]
    if check.merge_size is not None and MROPE_FIELD.name not in columns:
        problems.append("no mrope_positions, which an mRoPE processor's build stores")
    if check.merge_size is None and MROPE_FIELD.name in columns:
        problems.append("mrope_positions, which only an mRoPE processor's build stores")
    return problems


def image_row_problems(row: dict[str, Any], check: ImageCheck) -> list[str]:
    """Every broken promise of one sound pack row's images (row_problems found none in the rest of it)."""
    k = len(row["image_refs"])
    counts = {name: len(row[name]) for name in IMAGE_COLUMNS}
    expected = {name: k * {"image_grids": 3, "image_spans": 2}.get(name, 1) for name in IMAGE_COLUMNS}
    if counts != expected:
        return [f"image columns hold {counts} values for {k} images (3 grid and 2 span values an image)"]
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    labels = np.asarray(row["labels"], dtype=np.int64)
    docs = np.asarray(row["doc_cu_seqlens"], dtype=np.int64)
    spans = np.asarray(row["image_spans"], dtype=np.int64).reshape(-1, 2)
    grids = np.asarray(row["image_grids"], dtype=np.int64).reshape(-1, 3)
    documents = np.asarray(row["image_documents"], dtype=np.int64)
    problems = []
    if ((documents < 0) | (documents >= len(docs) - 1)).any() or (np.diff(documents) < 0).any():
        return [f"image_documents {documents.tolist()} are not documents of the pack, in order"]
    inside = (docs[documents] <= spans[:, 0]) & (spans[:, 0] < spans[:, 1]) & (spans[:, 1] <= docs[documents + 1])
    if not inside.all() or (spans[1:, 0] < spans[:-1, 1]).any():
        return [f"image_spans {spans.tolist()} are not in order, each inside its document"]
    covered = np.zeros(len(ids), dtype=bool)
    for i, ((start, end), grid) in enumerate(zip(spans.tolist(), grids.tolist())):
        where = f"image {i} ({row['image_refs'][i] or 'embedded'})"
        covered[start:end] = True
        planned = int(np.prod(grid)) // check.merge_size**2 if check.merge_size is not None else end - start
        if end - start != planned:
            problems.append(f"{where}: {end - start} tokens, its grid {grid} gives {planned}")
        if check.token is None or (ids[start:end] != check.token).any():
            problems.append(f"{where}: a token of its span [{start}, {end}) is not the image token {check.token}")
        if (labels[start:end] != IGNORE_INDEX).any():
            problems.append(f"{where}: a token of its span [{start}, {end}) carries a label")
    if check.token is not None and (ids[~covered] == check.token).any():
        problems.append(f"the image token {check.token} outside every image span (the model would take it for one)")
    problems += _bytes_problems(row, check)
    if check.merge_size is not None and not problems:
        problems += _positions_problems(row, ids, docs, spans, grids, documents, check.merge_size)
    check.images += k
    check.image_tokens += int((spans[:, 1] - spans[:, 0]).sum())
    return problems


def _bytes_problems(row: dict[str, Any], check: ImageCheck) -> list[str]:
    problems = []
    for i, (reference, digest, size, data) in enumerate(
        zip(row["image_refs"], row["image_sha256"], row["image_sizes"], row["image_data"])
    ):
        if data:
            check.embedded += 1
            if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
                problems.append(f"image {i} ({reference or 'embedded'}): its stored bytes do not hash as recorded")
        elif not reference:
            problems.append(f"image {i}: neither a file reference nor stored bytes")
        elif check.embed:
            problems.append(f"image {i} ({reference}): images: embed, but its bytes are not in the shard")
        else:
            problems += _file_problems(reference, digest, check)
    return problems


def _file_problems(reference: str, digest: str, check: ImageCheck) -> list[str]:
    """A referenced file under vision.root against its recorded sha256, each file hashed once per verify."""
    path = check.root / reference
    if reference not in check.files:
        try:
            check.files[reference] = sha256_file(path)
        except OSError as error:
            check.files[reference] = None
            return [f"image {path}: cannot be read ({error.strerror or error}); the shards reference it"]
    found = check.files[reference]
    if found is None:
        return []  # named once already
    if found != digest:
        return [f"image {path}: sha256 {found[:12]}..., the shards record {digest[:12]}... (changed after the build)"]
    return []


def _positions_problems(
    row: dict[str, Any],
    ids: np.ndarray,
    docs: np.ndarray,
    spans: np.ndarray,
    grids: np.ndarray,
    documents: np.ndarray,
    merge_size: int,
) -> list[str]:
    stored = np.asarray(row[MROPE_FIELD.name], dtype=np.int64)
    if len(stored) != 3 * len(ids):
        return [f"mrope_positions holds {len(stored)} values for 3 x {len(ids)} tokens"]
    rows = []
    for d in range(len(docs) - 1):
        mine = documents == d
        try:
            rows.append(
                document_positions(
                    int(docs[d + 1] - docs[d]), (spans[mine] - docs[d]).tolist(), grids[mine].tolist(), merge_size
                )
            )
        except ValueError as error:
            return [f"document {d}: positions cannot be recomputed from its images ({error})"]
    recomputed = np.concatenate(rows, axis=1).reshape(-1)
    if not np.array_equal(stored, recomputed):
        first = int(np.flatnonzero(stored != recomputed)[0])
        return [
            f"mrope_positions differ from those recomputed from the grids (first at row {first // len(ids)}, "
            f"token {first % len(ids)})"
        ]
    return []


def count_problems(folder: Path, manifest: Manifest, check: ImageCheck) -> list[str]:
    """The manifest's vision counts against what the shards held (every row read and sound)."""
    vision = manifest.vision or {}
    found = {"n_images": check.images, "n_image_tokens": check.image_tokens}
    return [
        f"{folder / MANIFEST}: vision.{key} is {vision.get(key)}, the shards hold {value}"
        for key, value in found.items()
        if vision.get(key) != value
    ]
