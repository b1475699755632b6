"""A source's records, in order: each one a `Parsed` record or the `RecordError` saying why not.

Two steps per file: packtool.reading turns its bytes into raw records (by content, not suffix;
size, NaN, NUL and surrogate checks), and the format's adapter (packtool.adapters) maps each one
to an `Example`, `PreferencePair` or `CompletionGroup` or raises `RecordError` naming the field.
Each record has one location, `FILE:N` (N is the line, 1-based, for JSON Lines; the row, 0-based,
for everything else) and, without an id field, the default id `{source}:{FILE}:{N}`, computable
from that one file alone. The build applies the error policy, so a bad record is never silently
lost: it fails the build or lands in rejects.jsonl.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain, islice
from pathlib import Path
from typing import Any

from packtool.adapters import (
    ADAPTERS,
    IMAGE_FORMATS,
    NO_PROCESSOR,
    Adapter,
    Parsed,
    refuse_media,
    refuse_videos,
    with_images,
    with_system,
)
from packtool.config import SourceConfig
from packtool.errors import RecordError
from packtool.reading import Span, raw_records
from packtool.records import Example


def source_files(source: SourceConfig) -> list[str]:
    """The files of a source in reading order: its globs expanded and sorted, as the config resolved them."""
    return list(source.paths)


def file_label(source: SourceConfig, file: str) -> str:
    """FILE in locations and default ids: the path as written in the config (relative to its folder)."""
    return source.labels.get(file, file)


def read_source(source: SourceConfig, *, images: bool = False) -> Iterator[Parsed | RecordError]:
    """Every record of a source (files in order) as an Example or the RecordError saying why it is not one.

    `max_samples` keeps the first N records; a bad record counts as one of them. `images`: as `read_file`
    (read records as the build reads them: `config.processor is not None`).
    """
    records = chain.from_iterable(read_file(source, file, images=images) for file in source_files(source))
    return islice(records, source.max_samples) if source.max_samples is not None else records


def read_file(
    source: SourceConfig,
    file: str,
    start: int = 0,
    stop: int | None = None,
    span: Span | None = None,
    *,
    images: bool = False,
) -> Iterator[Parsed | RecordError]:
    """Records start..stop of one file (positions count from 0: JSON Lines lines, or rows). `span`: the range
    the plan hashed, which bounds the read and records what was read (reading.Span). `images`: the build has a
    processor, so a record of IMAGE_FORMATS keeps its images (Example.images); otherwise a record with images
    is an `images_not_supported` reject.

    A file that cannot be read at all yields one `RecordError(kind="unreadable_file", row=None)`;
    one that breaks part way yields the records before the break, then that error with the row.
    """
    label = file_label(source, file)
    adapter = ADAPTERS[source.format]
    # where the record's relative image paths are: the source's image_root, or the data file's folder
    base = Path(source.image_root or Path(file).parent) if images and source.format in IMAGE_FORMATS else None
    for n, record in raw_records(file, label, start, stop, source.max_record_bytes, span):
        location = f"{label}:{n}"
        default_id = f"{source.name}:{location}"
        if isinstance(record, RecordError):
            if not record.file:  # a record-level problem found by a reader that knows only the row
                record.file, record.row = label, n
            record.sample_id = f"{source.name}:{label}" if record.row is None else default_id
            yield record
            continue
        yield _example(record, source, adapter, label, n, default_id, base)


def _example(
    record: Any, source: SourceConfig, adapter: Adapter, label: str, n: int, default_id: str, base: Path | None
) -> Parsed | RecordError:
    """One record parsed; `base`: where its relative image paths are, None when its images are not built."""
    try:
        if not isinstance(record, dict):
            raise RecordError(f"expected a JSON object, got {type(record).__name__}")
        example_id = _example_id(record, source, default_id)
        if base is None:
            refuse_media(record, source.fields.get("messages"), _why_no_images(source))
            parsed = adapter(record, source, example_id, f"{label}:{n}")
        else:
            refuse_videos(record)
            parsed = adapter(record, source, example_id, f"{label}:{n}")
            assert isinstance(parsed, Example)  # the IMAGE_FORMATS' adapters give examples
            parsed = with_images(parsed, record, source, base)
        return parsed if source.system is None else with_system(parsed, source.system)
    except RecordError as error:
        error.file, error.row = label, n
        error.sample_id = default_id
        return error
    except RecursionError:
        return RecordError("nested too deeply to read", kind="parse_error", file=label, row=n, sample_id=default_id)


def _why_no_images(source: SourceConfig) -> str:
    if source.format in IMAGE_FORMATS:
        return NO_PROCESSOR
    return f"packtool builds images in format {', '.join(sorted(IMAGE_FORMATS))} records, not {source.format}"


def _example_id(record: dict, source: SourceConfig, default: str) -> str:
    id_field = source.fields.get("id")
    if id_field and record.get(id_field) is not None:
        return str(record[id_field])
    return default
