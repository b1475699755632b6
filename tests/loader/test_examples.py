import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_train_plain_runs(make_build, examples_on_path, capsys):
    import train_plain

    path, _ = make_build(n_packs=30, capacity=64)
    common = [str(path), "--steps", "2", "--token-budget", "128", "--vocab-size", "128"]
    for extra in ([], ["--chunked-loss"], ["--packs-per-step", "4", "--alpha", "32"]):
        losses = train_plain.main([*common, *extra])
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    out = capsys.readouterr().out
    assert "'target_tokens':" in out and "'loss_denominator':" in out and "'attn_cost':" in out


def test_train_hf_trainer_logs_window_metrics(make_build, examples_on_path, tmp_path):
    import train_hf_trainer

    path, _ = make_build(n_packs=30, capacity=64)
    logs = train_hf_trainer.main(
        [str(path), "--output", str(tmp_path / "out"), "--steps", "2", "--accum", "2", "--vocab-size", "128"]
    )
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    assert all(log["input_tokens"] > log["target_tokens"] > 0 and log["segments"] >= 4 for log in logs)
    del sys.modules["train_hf_trainer"]
