"""`packtool decontaminate OUT --against EVAL`: an existing build checked against an eval set, without rebuilding.

    OUT's shards --documents--> each sample's text, decoded with the build's tokenizer, as
        prompt pieces (runs of content tokens that are not targets) and target pieces (runs of targets)
    --EvalIndex.check (packtool.decontamination, the build's own matching)--> findings per sample

A sample overlapping an eval string in its targets is contaminated (the command exits 1, like verify finding a
problem); an overlap in its prompt only is listed apart and does not fail. Template tokens (role `template`)
are no one's words and are not checked. Each sample is checked once: later copies (up-sampling) are skipped, the
pieces of a split document are each checked. The report names the eval files by their sha256, so it is bound to
the eval set it was made with, as the manifest's `decontamination` is for a build that checked while encoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from packtool.commands.show import load_decoder
from packtool.config import Decontamination
from packtool.decontamination import EvalSet, Finding, Sample, eval_set
from packtool.format import ROLE_CODES, read_manifest
from packtool.labels import IGNORE_INDEX

BATCH = 512  # samples checked together (the encode stage's chunk)
_NOT_CONTENT = np.array([ROLE_CODES["template"], ROLE_CODES["padding"]], np.int8)


@dataclass(frozen=True, slots=True)
class Document:
    """One document of a pack: where it is, whose it is, and its text as the check reads it."""

    sample_id: str
    source: str
    where: str  # SHARD:ROW/DOCUMENT, relative to OUT
    pieces: Sample


@dataclass
class DecontaminationReport:
    out: str
    evals: EvalSet
    documents: int = 0
    contaminated: list[dict[str, Any]] = field(default_factory=list)  # target overlaps: the command fails
    prompt_only: list[dict[str, Any]] = field(default_factory=list)  # listed, not failing

    @property
    def ok(self) -> bool:
        return not self.contaminated

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "out": self.out,
            "decontamination": self.evals.record(),
            "documents": self.documents,
            "contaminated": self.contaminated,
            "prompt_only": self.prompt_only,
        }


def decontaminate(out: Path, settings: Decontamination) -> DecontaminationReport:
    """Check every document of OUT (its sub-outputs too) against the eval set `settings` names."""
    evals = eval_set(settings)
    report = DecontaminationReport(str(out), evals)
    batch: list[Document] = []
    for document in _documents(out):
        batch.append(document)
        if len(batch) == BATCH:
            _check(batch, evals, report)
            batch = []
    _check(batch, evals, report)
    return report


def _check(batch: list[Document], evals: EvalSet, report: DecontaminationReport) -> None:
    report.documents += len(batch)
    for document, finding in zip(batch, evals.index.check([d.pieces for d in batch]), strict=True):
        if finding is not None:
            listed = report.contaminated if finding.part == "target" else report.prompt_only
            listed.append(_entry(document, finding))


def _entry(document: Document, finding: Finding) -> dict[str, Any]:
    return {"id": document.sample_id, "source": document.source, "at": document.where, "eval": finding.as_dict()}


def _documents(out: Path) -> Iterator[Document]:
    """Each document of OUT's shards and of its sub-outputs' (validation, overflow), a sample's copies once."""
    manifest = read_manifest(out)
    parts = [manifest, *(read_manifest(out / folder) for folder in manifest.parts.values())]
    decoder = None
    seen: set[str] = set()
    for part in parts:
        for shard in part.shards:
            decoder = decoder or load_decoder(shard.file, manifest, None, out)
            table = pq.read_table(
                shard.file, columns=["input_ids", "labels", "token_roles", "doc_cu_seqlens", "sample_ids", "sources"]
            )
            for row, pack in enumerate(table.to_pylist()):
                where = f"{shard.file.relative_to(out).as_posix()}:{row}"
                yield from _pack_documents(pack, where, decoder, seen)


def _pack_documents(pack: dict[str, Any], where: str, decoder: Any, seen: set[str]) -> Iterator[Document]:
    ids = np.asarray(pack["input_ids"], np.int32)
    targets = np.asarray(pack["labels"], np.int32) != IGNORE_INDEX
    content = ~np.isin(np.asarray(pack["token_roles"], np.int8), _NOT_CONTENT)
    bounds = pack["doc_cu_seqlens"]
    for d, (start, end) in enumerate(pairwise(bounds)):
        sample_id = pack["sample_ids"][d]
        text_key = f"{sample_id}\0{ids[start:end].tobytes().hex()}"  # a split document's pieces differ
        if text_key in seen:
            continue
        seen.add(text_key)
        prompts: list[str] = []
        answers: list[str] = []
        # runs of tokens alike in (target, content): each run decoded alone is one piece
        kinds = targets[start:end] * 2 + content[start:end]
        cuts = np.flatnonzero(np.diff(kinds)) + 1
        for run_start, run_end in zip([0, *cuts.tolist()], [*cuts.tolist(), end - start], strict=True):
            kind = int(kinds[run_start])
            if kind in (0, 2):  # template text (a trained end-of-turn marker too): no one's words
                continue
            text = decoder.decode(ids[start + run_start : start + run_end].tolist(), skip_special_tokens=False)
            (answers if kind == 3 else prompts).append(text)
        yield Document(sample_id, pack["sources"][d], f"{where}/{d}", (prompts, answers))


def format_decontamination(report: DecontaminationReport) -> str:
    files = ", ".join(f"{f['file']} (sha256 {f['sha256'][:12]})" for f in report.evals.files)
    lines = [f"{report.out}: {report.documents:,} documents checked against {files}"]
    for title, entries in (("contaminated (in targets)", report.contaminated), ("in prompts only", report.prompt_only)):
        lines.append(f"{title}: {len(entries)}")
        for e in entries[:20]:
            ev = e["eval"]
            lines.append(f"  {e['id']} ({e['source']}, {e['at']}): eval {ev['record']} {ev['field']} ({ev['rule']})")
        if len(entries) > 20:
            lines.append(f"  ... {len(entries) - 20} more (--json lists all)")
    return "\n".join(lines)
