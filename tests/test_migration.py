"""docs/config.md's migration examples (docs/migration/*.yaml) build, verify, and train what their comments say."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
from click.testing import CliRunner
from support import REPO

from packtool.cli import main
from packtool.format import read_manifest
from packtool.labels import IGNORE_INDEX
from packtool.records import ROLE_CODES

EXAMPLES = REPO / "docs" / "migration"


def _build(name: str, out) -> dict:
    result = CliRunner().invoke(main, ["build", str(EXAMPLES / f"{name}.yaml"), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    verified = CliRunner().invoke(main, ["verify", str(out)])
    assert verified.exit_code == 0, verified.output
    return read_manifest(out).raw


def _per_source(out) -> dict[str, dict[str, int]]:
    """Per source: user tokens that are targets, assistant tokens that are not, documents."""
    counts: dict[str, dict[str, int]] = {}
    for shard in sorted(out.glob("shard-*.parquet")):
        for row in pq.read_table(shard).to_pylist():
            labels, roles, docs = np.array(row["labels"]), np.array(row["token_roles"]), row["doc_cu_seqlens"]
            for d, source in enumerate(row["sources"]):
                target = labels[docs[d] : docs[d + 1]] != IGNORE_INDEX
                role = roles[docs[d] : docs[d + 1]]
                entry = counts.setdefault(source, {"user_targets": 0, "assistant_context": 0, "documents": 0})
                entry["user_targets"] += int((target & (role == ROLE_CODES["user"])).sum())
                entry["assistant_context"] += int((~target & (role == ROLE_CODES["assistant"])).sum())
                entry["documents"] += 1
    return counts


def test_every_example_is_in_the_config_doc():
    doc = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert names == ["axolotl.yaml", "llamafactory.yaml", "trl.yaml"]
    for name in names:
        assert name in doc
    for setting in ["max_length", "padding_free", "assistant_only_loss", "completion_only_loss", "sequence_len",
                    "sample_packing", "train_on_inputs", "roles_to_train", "train_on_eos", "cutoff_len",
                    "neat_packing", "train_on_prompt", "mask_history", "val_size", "max_samples"]:  # fmt: skip
        assert f"`{setting}" in doc, setting


def test_trl_assistant_and_completion_only_loss(tmp_path):
    manifest = _build("trl", tmp_path / "out")
    assert manifest["capacity"] == 1024 and manifest["packing"]["strategy"] == "bfd"
    assert manifest["stats"]["segments_per_pack"]["max"] > 1  # packing=True
    counts = _per_source(tmp_path / "out")
    assert counts["chat"]["user_targets"] == counts["instructions"]["user_targets"] == 0
    assert counts["chat"]["assistant_context"] == 0  # every assistant turn is trained


def test_axolotl_train_on_inputs(tmp_path):
    manifest = _build("axolotl", tmp_path / "out")
    assert manifest["packing"]["strategy"] == "ffd"
    counts = _per_source(tmp_path / "out")
    assert counts["instructions"]["user_targets"] > 0  # train_on_inputs: the prompt is trained
    assert counts["chat"]["user_targets"] == 0  # roles_to_train: [assistant]


def test_llamafactory_mask_history(tmp_path):
    _build("llamafactory", tmp_path / "out")
    counts = _per_source(tmp_path / "out")
    assert counts["chat"]["assistant_context"] > 0  # earlier assistant turns are context only
    assert counts["chat"]["user_targets"] == 0 and counts["docs"]["documents"] > 0
