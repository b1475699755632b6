"""The image rows of `packtool audit --probe` (packtool.loader.vision_probe): on tiny random Qwen2-VL, Qwen2.5-VL
and Qwen3-VL, packed image documents fed by model_inputs give each document's logits, vision tower outputs and
vision gradients of the document alone, and changing one image moves no other document; without the text
row of the positions they leak, and the probe says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402

from packtool.cli import main  # noqa: E402
from packtool.loader import vision_probe  # noqa: E402
from packtool.loader.probe import CPU_BACKENDS, FAMILIES, build_tiny, family_config  # noqa: E402
from packtool.loader.vision_probe import IMAGE_CHECKS, TOWERS, image_row, image_table  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VISION_FAMILIES = [key for key, family in FAMILIES.items() if family.model_type in TOWERS]


def test_every_vision_family_is_in_the_table():
    assert sorted(VISION_FAMILIES) == sorted(TOWERS)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("key", VISION_FAMILIES)
def test_packed_image_documents_stay_apart(key, backend):
    row = image_row(build_tiny(family_config(FAMILIES[key]), backend))
    assert row.status == "pass", row
    assert [check.check for check in row.checks] == list(IMAGE_CHECKS)
    assert all(check.worst <= 1e-6 for check in row.checks)


@pytest.mark.parametrize("key", VISION_FAMILIES)
def test_without_the_text_row_the_documents_leak_and_are_named(key, monkeypatch):
    """t/h/w positions alone (what a loader feeding 3-row positions gives): no document boundary reaches attention."""
    fed = vision_probe.model_inputs

    def three_rows(mb, model):
        inputs = fed(mb, model)
        return {**inputs, "position_ids": inputs["position_ids"][1:]}

    monkeypatch.setattr(vision_probe, "model_inputs", three_rows)
    row = image_row(build_tiny(family_config(FAMILIES[key]), "sdpa"))
    assert row.status == "leak"
    failed = {check.check for check in row.checks if not check.ok}
    assert {"image_logits", "image_change"} <= failed
    assert "vision_outputs" not in failed  # the vision tower is per image whatever the text positions
    assert row.detail.startswith("packed image documents differ from each alone (image_logits")


def test_the_cli_probe_shows_the_image_row():
    result = CliRunner().invoke(main, ["audit", "--probe", "qwen2_5_vl", "--backend", "sdpa"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^sdpa +model_inputs\+images +- +- +- +- +(\S+ +){4}PASS$", result.output, re.M), result.output
    assert "image_change" in result.output.splitlines()[1 + result.output.count("note:")]


def test_docs_image_table_is_the_code_table():
    text = (REPO / "docs" / "isolation.md").read_text()
    documented = re.search(r"<!-- image-table:start -->\n(.*?)\n<!-- image-table:end -->", text, re.S)
    assert documented is not None
    assert documented.group(1) == image_table()
