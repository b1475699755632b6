"""OUT/README.md, the dataset card: what the Hugging Face Hub shows and `datasets.load_dataset(OUT)` reads.

    ---                                   YAML front matter (the Hub's metadata, read by `datasets`)
    license, pretty_name, language, ...   the config's `card:` section, when given
    configs:                              default: train = the root shards, validation = validation/'s
      - config_name: default                (when the build holds one out); overflow: its own config, never
        data_files: [{split, path}]         mixed into train
    dataset_info:                         per config: the shard schema as `datasets` features, and each
      - features, splits                    split's packs (num_examples: `datasets` checks them as it loads)
    ---
    # title                               the body, from the manifests: splits, sources and their shares,
    ...                                   tokenizer, template, capacity, token efficiency, decontamination,
                                          how to read the packs

The card is written from the manifests alone (the main one before its `card` field and seal, and those of
overflow/ and validation/), once every shard is written: the same bytes on every executor, resume and
rerun. The main manifest then records its size and sha256 (`card`), which `verify` checks.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from packtool.config import CARD_LISTS, Card
from packtool.format import CARD, SCHEMA, SCHEMA_V2, SCHEMA_VERSION, json_text, sha256_file, vision_schema
from packtool.vision.processors import QWEN_PROCESSORS

# The part of the card another section of packtool may fill: the manifest's optional `decontamination` field.
DECONTAMINATION_MARK = "<!-- packtool card: decontamination (the manifest's `decontamination`) -->"

# Arrow types of the shard schema as `datasets` names them in a card's features.
_DTYPES = {
    pa.int8(): "int8",
    pa.int16(): "int16",
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.float64(): "float64",
    pa.string(): "string",
    pa.binary(): "binary",
}


def write_card(folder: Path, text: str) -> dict[str, Any]:
    """Write the card into `folder` (a temporary name, then renamed) and return the manifest's `card` entry."""
    path = folder / CARD
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(text.encode("utf-8"))
    os.replace(temporary, path)
    return {"file": CARD, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def card_text(card: Card, manifest: dict[str, Any], parts: dict[str, dict[str, Any]]) -> str:
    """The whole card: YAML front matter, then the Markdown body. `manifest` is the main folder's, `parts` the
    sub-outputs' manifests by folder name (as written).

    Both are read as their JSON text reads back (keys sorted): the card is a function of the manifests' bytes,
    never of the order a build (fresh or resumed) filled a mapping in; sources are listed in the config's order."""
    manifest = json.loads(json_text(manifest))
    parts = {name: json.loads(json_text(part)) for name, part in parts.items()}
    splits = output_splits(manifest, parts)
    front = yaml.safe_dump(front_matter(card, manifest, splits), sort_keys=False, allow_unicode=True, width=1000)
    return f"---\n{front}---\n\n" + "\n".join(_body(card, manifest, splits)) + "\n"


@dataclass(frozen=True, slots=True)
class Split:
    """One folder of a build as a `datasets` split: its config, split name, folder in OUT and manifest."""

    config: str
    name: str
    folder: str  # "" for OUT itself
    manifest: dict[str, Any]

    @property
    def packs(self) -> int:
        return sum(int(s.get("rows", 0)) for s in self.manifest.get("shards", []) if isinstance(s, dict))

    @property
    def bytes(self) -> int:
        return sum(int(s.get("bytes", 0)) for s in self.manifest.get("shards", []) if isinstance(s, dict))

    @property
    def files(self) -> str:
        return f"{self.folder}/shard-*.parquet" if self.folder else "shard-*.parquet"

    @property
    def stats(self) -> dict[str, Any]:
        stats = self.manifest.get("stats")
        return stats if isinstance(stats, dict) else {}


def output_splits(manifest: dict[str, Any], parts: dict[str, dict[str, Any]]) -> list[Split]:
    """The folders of a build as `datasets` splits, those with packs only (a glob matching no file is an error to
    `datasets`). The overflow bucket is a config of its own: its packs have another capacity, and training on
    them is a choice."""
    found = [Split("default", "train", "", manifest)]
    for key, config, name in (("validation", "default", "validation"), ("overflow", "overflow", "train")):
        part = manifest.get(key)
        if isinstance(part, dict) and part.get("folder") in parts:
            found.append(Split(config, name, part["folder"], parts[part["folder"]]))
    return [split for split in found if split.packs > 0]


def front_matter(card: Card, manifest: dict[str, Any], splits: list[Split]) -> dict[str, Any]:
    """The card's YAML: the config's `card:` metadata, then `configs` and `dataset_info` for `datasets`."""
    front: dict[str, Any] = {}
    for key in ("license", "pretty_name"):
        if getattr(card, key):
            front[key] = getattr(card, key)
    for key in CARD_LISTS:
        if getattr(card, key):
            front[key] = list(getattr(card, key))
    configs = list(dict.fromkeys(s.config for s in splits))
    front["configs"] = [
        {
            "config_name": config,
            "data_files": [{"split": s.name, "path": s.files} for s in splits if s.config == config],
        }
        for config in configs
    ]
    schema = SCHEMA if manifest.get("schema_version") == SCHEMA_VERSION else SCHEMA_V2
    vision = manifest.get("vision")
    if vision is not None:  # the image columns, and positions for the mRoPE families (builder.plan.vision_plan)
        schema = vision_schema(schema, mrope=vision["processor"]["family"] in QWEN_PROCESSORS.values())
    front["dataset_info"] = [
        {
            "config_name": config,
            "features": features(schema),
            # num_bytes: the split's Parquet bytes (the Hub shows them; `datasets` checks only num_examples)
            "splits": [
                {"name": s.name, "num_bytes": s.bytes, "num_examples": s.packs} for s in splits if s.config == config
            ],
        }
        for config in configs
    ]
    return front


def features(schema: pa.Schema) -> list[dict[str, str]]:
    """The shard schema as a card's `features` (`datasets`' YAML: `list: int32` for a list column)."""
    return [
        {"name": f.name, "list": _DTYPES[f.type.value_type]}
        if pa.types.is_list(f.type)
        else {"name": f.name, "dtype": _DTYPES[f.type]}
        for f in schema
    ]


def _body(card: Card, manifest: dict[str, Any], splits: list[Split]) -> list[str]:
    title = " ".join((card.pretty_name or "Packed training data").split())
    lines = [f"# {title}", ""]
    if card.description:
        lines += [card.description.strip(), ""]
    capacity = manifest.get("capacity")
    lines += [
        f"Training packs written by packtool {manifest.get('packtool_version', '')}. Each row is one "
        f"pack of at most {_number(capacity)} tokens holding whole samples side by side: `cu_seqlens` marks where "
        "each sample starts, `labels` is -100 wherever a token is not trained, and positions restart at 0 in "
        "every segment. A reader must keep attention inside each segment (packtool's loader does).",
        "",
        "## Splits",
        "",
        "| config | split | folder | packs | tokens | targets | capacity | token efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in splits:
        counts = [_number(s.stats.get(key)) for key in ("packs", "tokens", "targets")]
        lines.append(
            f"| {s.config} | {s.name} | `{s.folder or '.'}/` | {' | '.join(counts)} | "
            f"{_number(s.manifest.get('capacity'))} | {_ratio(s.stats.get('token_efficiency'))} |"
        )
    lines += [
        "",
        "Token efficiency is tokens / (packs x capacity): the share of the packs' room that holds tokens.",
        "",
    ]
    lines += _sources(manifest)
    lines += _recipe(manifest)
    lines += ["## Decontamination", "", DECONTAMINATION_MARK, *_decontamination(manifest.get("decontamination")), ""]
    lines += _reading(splits, capacity if isinstance(capacity, int) else 0)
    return lines


def _sources(manifest: dict[str, Any]) -> list[str]:
    """Per source: where it came from, what became of its records, and its share of the train split."""
    lines = [
        "## Sources",
        "",
        "| source | format | path | read | kept | rejected | dropped | segments | token share | target share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    written = {s.get("name"): s for s in manifest.get("config", {}).get("sources", []) if isinstance(s, dict)}
    stats = manifest.get("stats")
    shares = stats.get("sources", {}) if isinstance(stats, dict) else {}
    accounting = manifest.get("accounting", {})
    for name in [*(n for n in written if n in accounting), *(n for n in accounting if n not in written)]:
        counts, source, share = accounting[name], written.get(name, {}), shares.get(name, {})
        paths = source.get("path", "")
        paths = ", ".join(map(str, paths)) if isinstance(paths, list) else str(paths)
        cells = [_code(name), _code(source.get("format", "messages")), _code(paths)]
        cells += [_number(counts.get(key)) for key in ("read", "kept")]
        cells += [_number(sum(counts.get(key, {}).values())) for key in ("rejected", "dropped")]
        cells += [_number(counts.get("segments"))] + [_ratio(share.get(key)) for key in ("token_share", "target_share")]
        lines.append("| " + " | ".join(cells) + " |")
    rejects = manifest.get("rejects", {})
    reasons = ", ".join(f"{reason} {count:,}" for reason, count in rejects.get("by_reason", {}).items())
    lines += [
        "",
        f"Shares are of the train split. Records not trained: {_number(rejects.get('count'))}"
        + (f" ({reasons})" if reasons else "")
        + f", each with its reason in `{rejects.get('file', 'rejects.jsonl')}`.",
        "",
    ]
    return lines


def _recipe(manifest: dict[str, Any]) -> list[str]:
    """What made the tokens: tokenizer, template, truncation, packing, seed and the hashes that pin them."""
    config, tokenizer = manifest.get("config", {}), manifest.get("tokenizer", {})
    template = manifest.get("template")
    truncation, packing = manifest.get("truncation", {}), manifest.get("packing", {})
    lines = [
        "## How it was made",
        "",
        f"- tokenizer: {_code(config.get('tokenizer', ''))} (tokenizer.json sha256 "
        f"{_code(tokenizer.get('sha256', ''))}, vocabulary {_number(tokenizer.get('vocab_size'))})",
        f"- chat template: {_code(template.get('name', ''))} (sha256 {_code(template.get('sha256', ''))})"
        if isinstance(template, dict)
        else "- chat template: none (every source is plain text)",
        f"- capacity: {_number(manifest.get('capacity'))} tokens per pack; "
        f"mode {_code(manifest.get('mode', 'packed'))}",
        f"- packing: {_code(packing.get('strategy', ''))}; truncation: {_code(truncation.get('strategy', ''))}"
        f" (fallback {_code(truncation.get('fallback', ''))})",
        # not the plan hash: it names the encode work items, which a file's row ranges decide, never the bytes
        f"- seed {manifest.get('seed')}; config sha256 {_code(manifest.get('config_hash', ''))}",
        "",
        "`manifest.json` holds all of it, the config as written and every shard's sha256; "
        "`packtool verify .` checks every byte against it.",
        "",
    ]
    return lines


def _decontamination(record: Any) -> list[str]:
    """The manifest's `decontamination`, whatever its fields (read defensively: a reader of any build writes its
    card): a value per line, then each list or mapping of records (eval files, sources) as a table."""
    if record is None:
        return ["This build records no decontamination against evaluation sets."]
    if not isinstance(record, dict):
        return [f"The manifest records {_code(_json(record))}."]
    lines, tables = ["As the manifest's `decontamination` records it:", ""], []
    for key, value in record.items():
        rows = _records(value)
        if rows is None:
            lines.append(f"- {key}: {_code(_json(value))}")
            continue
        columns = list(dict.fromkeys(column for row in rows for column in row))
        tables += ["", f"{key}:", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        tables += ["| " + " | ".join(_code(_json(row.get(c, ""))) for c in columns) + " |" for row in rows]
    return lines + tables


def _records(value: Any) -> list[dict[str, Any]] | None:
    """A non-empty list of objects, or a mapping of names to objects (each row then starts with its name)."""
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return value
    if isinstance(value, dict) and value and all(isinstance(item, dict) for item in value.values()):
        return [{"name": name, **item} for name, item in value.items()]
    return None


def _reading(splits: list[Split], capacity: int) -> list[str]:
    budget = max(8192, capacity)  # a micro-batch holds whole packs: a budget under the capacity is refused
    loads = ['packs = load_dataset("PATH")  # ' + ", ".join(s.name for s in splits if s.config == "default")]
    if any(s.config == "overflow" for s in splits):
        loads.append('overflow = load_dataset("PATH", "overflow")  # the longer packs, kept apart')
    held_out = next((s.folder for s in splits if s.name == "validation"), None)
    return [
        "## Reading the packs",
        "",
        "PATH is this folder, or its Hub repo id. With `datasets`, one row per pack:",
        "",
        "```python",
        "from datasets import load_dataset",
        "",
        *loads,
        "```",
        "",
        "With packtool's loader (`pip install packtool[loader]`, on a local copy: "
        "`hf download REPO --repo-type dataset --local-dir PATH`), which checks each shard's sha256, keeps "
        "every sample's attention to itself and sums the loss over the targets of a whole update:",
        "",
        "```python",
        "from packtool.loader import PackedDataset, packed_batches",
        "",
        f'dataset = PackedDataset("PATH", token_budget={budget}, seed=0)',
        "for batch in packed_batches(dataset):  # input_ids, labels, position_ids, cu_seqlens, max_seqlen",
        "    ...",
        *([f'held_out = PackedDataset("PATH/{held_out}", token_budget={budget}, shuffle=False)'] if held_out else []),
        "```",
    ]


def _number(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else "—"


def _ratio(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float | int) and not isinstance(value, bool) else "—"


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


def _code(value: Any) -> str:
    """`value` as inline code in a table cell: one line, its pipes escaped, fenced past any backticks it holds."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    if not text:
        return ""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    padded = f" {text} " if text.startswith("`") or text.endswith("`") else text
    return f"{fence}{padded}{fence}"
