"""The outputs a build writes besides its shards: rejects.jsonl, README.md (the dataset card, builder.card) and
manifest.json (docs/format.md).

The manifest's fields (format.ManifestFields, declared once with the readers' checks) are filled here from the
config, the setup (tokenizer, template), the plan and the shards emit wrote; packtool.format owns the contract
(the fields, the codes, the seal) and writes it, last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

import packtool
from packtool.arrow import list_parts
from packtool.builder.card import card_text, write_card
from packtool.builder.plan import Plan
from packtool.builder.stages import Stages
from packtool.canaries import choose_canaries
from packtool.chat_templates import ChatTemplate
from packtool.config import ITEM_FORMATS, BuildConfig, config_folder
from packtool.decontamination import EvalSet
from packtool.format import (
    CONTAMINATED,
    KIND_CODES,
    PROCESSOR_FOLDER,
    REJECTS,
    ROLE_CODES,
    SCHEMA_VERSION,
    Manifest,
    ManifestFields,
    conventions,
    write_manifest,
)
from packtool.render import template_injections
from packtool.shards import ShardInfo, read_columns
from packtool.summaries import length_summary, summarize
from packtool.vision.processors import PREPROCESSOR_CONFIG, PROCESSOR_FILES, load_processor


def write_outputs(
    config: BuildConfig, stages: Stages, plan: Plan, out: Path, infos: dict[str, list[ShardInfo]]
) -> dict[str, Any]:
    """rejects.jsonl, each sub-output's manifest (overflow bucket, validation split), the dataset card (README.md,
    written from those manifests and every field of the main one), then the main manifest (last), which records
    the card's sha256.

    Each manifest passes the readers' own check (format.Manifest) before its stats are taken from the shards,
    so a field the builder got wrong fails here, not in whichever reader meets it first."""
    parts: dict[str, dict[str, Any]] = {}
    written: dict[str, dict[str, Any]] = {}  # each sub-output's manifest as written, for the card
    for folder in plan.folders:
        if not folder.name:
            continue
        path = out / folder.name
        path.mkdir(parents=True, exist_ok=True)
        copy_rejects(None, path / REJECTS)  # a sub-output's records are the main output's
        published = Path(config.run.output) / folder.name
        shards = infos[folder.name]
        fields = assemble_manifest(config, stages, plan, folder.capacity, folder.stream, shards, {}, published)
        stats = _stats(fields, path, shards)
        fields = replace(fields, stats=stats, vision=vision_record(config, plan, path, stats, shards))
        written[folder.name] = write_manifest(path, fields.as_dict())
        parts[folder.name] = {
            "folder": folder.name,
            "capacity": folder.capacity,
            "packs": stats["packs"],
            "segments": len(folder.ref),
        }
        if folder.name == "validation":
            parts["validation"]["share"] = config.validation.share
            parts["validation"]["samples"] = config.validation.samples
    main = plan.folders[0]
    out.mkdir(parents=True, exist_ok=True)
    copy_rejects(plan.rejects.path, out / REJECTS)
    published = Path(config.run.output)
    by_reason = plan.rejects.by_reason
    fields = assemble_manifest(config, stages, plan, main.capacity, main.stream, infos[""], by_reason, published)
    fields = replace(fields, overflow=parts.get("overflow"), validation=parts.get("validation"))
    if stages.evals is not None:
        fields = replace(fields, decontamination=decontamination_record(stages.evals, plan.accounting))
    # the main folder only: overflow and validation packs keep the packer's order
    if config.mixing.interleave is not None:
        fields = replace(fields, mixing={**fields.mixing, "interleave": config.mixing.interleave.as_dict()})
    fields = replace(fields, stats=_stats(fields, out, infos[""]))
    fields = replace(fields, vision=vision_record(config, plan, out, fields.stats or {}, infos[""]))
    fields = replace(fields, canaries=_canaries(config, stages, fields, out, infos[""]))
    card = write_card(out, card_text(config.card, fields.as_dict(), written))
    return write_manifest(out, replace(fields, card=card).as_dict())


def vision_record(
    config: BuildConfig, plan: Plan, folder: Path, stats: dict[str, Any], shards: list[ShardInfo]
) -> dict[str, Any] | None:
    """The manifest's `vision` (a build whose config names an image processor): the processor's files copied into
    FOLDER/processor/ with their sha256 (a loader builds the image processor from the output alone), the image
    token, how images are stored, the folder references are relative to, and the counts the shards hold."""
    if plan.vision is None or config.processor is None:
        return None
    copied = folder / PROCESSOR_FOLDER
    copied.mkdir(exist_ok=True)
    files = {}
    for name in PROCESSOR_FILES:
        source = Path(config.processor) / name
        if source.is_file():
            data = source.read_bytes()
            (copied / name).write_bytes(data)
            files[name] = hashlib.sha256(data).hexdigest()
    settings = json.loads((copied / PREPROCESSOR_CONFIG).read_text(encoding="utf-8"))
    images = stats.get("images", {})
    return {
        "processor": {
            "family": load_processor(copied).family,
            "class": str(settings.get("processor_class") or settings.get("image_processor_type") or ""),
            "files": files,
        },
        "image_token_id": _image_token_id([folder / s.file for s in shards]),
        "images": config.images,
        "root": plan.vision.root,
        "n_images": images.get("images", 0),
        "n_image_tokens": images.get("image_tokens", 0),
    }


def _image_token_id(shards: list[Path]) -> int | None:
    """The token of the first image of the first shard holding one (verify checks every other span against it);
    None when no pack holds an image."""
    for shard in shards:
        table = read_columns(shard, ["input_ids", "image_spans"])
        span_offsets, spans = list_parts(table.column("image_spans"))
        token_offsets, input_ids = list_parts(table.column("input_ids"))
        holding = np.flatnonzero(np.diff(span_offsets))
        if len(holding):
            pack = int(holding[0])
            return int(input_ids[token_offsets[pack] + spans[span_offsets[pack]]])
    return None


def decontamination_record(evals: EvalSet, accounting: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's `decontamination`: the eval files (each one's sha256), the settings, and per source the samples
    dropped as contaminated and those kept with a reported overlap (as the accounting counts them)."""
    sources = {
        name: {"contaminated": a["dropped"].get(CONTAMINATED, 0), "reported": a.get("contamination_reported", 0)}
        for name, a in accounting.items()
    }
    return {
        **evals.record(),
        "contaminated": sum(s["contaminated"] for s in sources.values()),
        "reported": sum(s["reported"] for s in sources.values()),
        "sources": sources,
    }


def _stats(fields: ManifestFields, folder: Path, shards: list[ShardInfo]) -> dict[str, Any]:
    """The summary `packtool stats` prints, taken from the shards as the manifest (checked first) describes them."""
    return summarize([folder / s.file for s in shards], Manifest.from_dict(fields.as_dict(), folder))


def _canaries(
    config: BuildConfig, stages: Stages, fields: ManifestFields, folder: Path, shards: list[ShardInfo]
) -> dict[str, Any]:
    """The canary set `packtool canary` prints (docs/canary.md), chosen from the staged shards as that command
    would choose it from the published ones: recorded, so a later packtool never prints others for this build."""
    # the build's own tokenizer: what it changes of the file's (a pre-tokenizer, padding) never changes decoding
    decoder = stages.tokenizer.tokenizer
    files = [folder / s.file for s in shards]
    images = config.processor is not None
    return choose_canaries(files, fields.capacity, fields.accounting, decoder, config.sources, images=images).as_dict()


def copy_rejects(planned: Path | None, path: Path) -> None:
    """A rejects.jsonl: the plan's (PLAN/rejects.jsonl, copied a block at a time), or an empty one (None)."""
    temporary = path.with_name(path.name + ".tmp")
    if planned is None:
        temporary.write_bytes(b"")
    else:
        shutil.copyfile(planned, temporary)
    temporary.replace(path)


def assemble_manifest(
    config: BuildConfig,
    stages: Stages,
    plan: Plan,
    capacity: int,
    stream: bool,
    shards: list[ShardInfo],
    by_reason: dict[str, int],
    published: Path,
) -> ManifestFields:
    """Every field but the stats and the sub-outputs (write_outputs adds them once they are written);
    `by_reason`: the records of this output not trained, counted by reason."""
    tokenizer, template = stages.tokenizer, stages.template
    items = any(s.format in ITEM_FORMATS for s in config.sources)
    quotas = {s.name: asdict(s.plan.quota) for s in config.sources if s.plan.quota is not None}
    return ManifestFields(
        packtool_version=packtool.__version__,
        schema_version=plan.schema_version,
        mode="stream" if stream else "packed",
        capacity=capacity,
        seed=config.seed,
        config=config.raw,
        # where config's relative paths start: find reads the sources from there, wherever it is run from
        config_folder={
            "path": str(config_folder(config)),
            "relative": os.path.relpath(config_folder(config), published.resolve()),
        },
        config_hash=config.config_hash,
        plan_hash=plan.key,
        tokenizer={
            # relative to the folder the manifest is published in (not staged in): no machine path in the manifest
            "file": os.path.relpath(Path(tokenizer.path).resolve(), published.resolve()),
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.pad_id,
        },
        template=None
        if template is None
        else {
            **_template_entry(template),
            # the model's tool_use template, which renders the records that bring tools (as transformers does)
            **({"tools": _template_entry(template.for_tools)} if template.for_tools is not None else {}),
            # what every sample gets from the template alone (a default system prompt, a date line)
            "injects": template_injections(template, tokenizer),
        },
        truncation={
            "strategy": config.truncation.strategy,
            "fallback": config.truncation.fallback,
            **({"items": config.truncation.items} if items else {}),
        },
        packing={
            "strategy": config.packing.strategy,
            "group_by": config.packing.group_by,
            "max_segments": config.packing.max_segments,
            "shuffle": config.packing.shuffle,
            # only where pictures are placed: a text build packs the same either way, and its manifest stays as it was
            **({"balance_vision": config.packing.balance_vision} if config.processor is not None else {}),
        },
        mixing={
            "by": config.mixing.by,
            "weights": {s.name: s.plan.weight for s in config.sources},
            **({"quotas": quotas} if quotas else {}),  # only when asked for: other manifests stay byte for byte
            "loss_normalization": "token-level: sum of target losses / targets in the update window",
        },
        conventions=conventions(stream),
        role_codes=ROLE_CODES,
        shards=[asdict(s) for s in shards],
        accounting=_item_accounting(config, plan.accounting) if items else plan.accounting,
        # per source, sample lengths as encoded (before) and as packed (after truncation), against capacity
        lengths={
            name: {when: length_summary(tally, capacity) for when, tally in before_after.items()}
            for name, before_after in plan.lengths.items()
        },
        rejects={"file": REJECTS, "count": sum(by_reason.values()), "by_reason": dict(sorted(by_reason.items()))},
        # what segment_kinds holds; a v1 build keeps the v1 manifest byte for byte
        kind_codes=None if plan.schema_version == SCHEMA_VERSION else KIND_CODES,
    )


def _template_entry(template: ChatTemplate) -> dict[str, Any]:
    """A template's name and source hash; for a model's own template also the file it was read from
    (relative to the model folder) and its name among the model's templates (null for a lone one)."""
    return {"name": template.name, "sha256": template.sha256, "file": template.file, "named": template.named}


def _item_accounting(config: BuildConfig, accounting: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Sources of pairs or groups count items: `kept` is pairs (groups) kept, also under `pairs` (`groups`)."""
    counted = {}
    for source in config.sources:
        entry = dict(accounting[source.name])
        if source.format in ITEM_FORMATS:
            entry["pairs" if source.format == "preference" else "groups"] = entry["kept"]
        counted[source.name] = entry
    return counted
