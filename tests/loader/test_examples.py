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
    for extra in ([], ["--full-logits"], ["--packs-per-step", "4", "--alpha", "32"]):
        losses = train_plain.main([*common, *extra])
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    out = capsys.readouterr().out
    assert "'target_tokens':" in out and "'loss_denominator':" in out and "'attn_cost':" in out


def test_train_plain_runs_whole_epochs(make_build, examples_on_path, capsys):
    """--epochs 2: every micro-batch of epochs 0 and 1 once, in windows of --accum, then the loop ends."""
    import train_plain

    from packtool.loader import PackedDataset, packed_batches

    path, _ = make_build(n_packs=30, capacity=64)
    per_epoch = len(list(packed_batches(PackedDataset(path, seed=0, token_budget=128))))
    options = ["--epochs", "2", "--accum", "2", "--token-budget", "128", "--vocab-size", "128"]
    losses = train_plain.main([str(path), *options])
    assert len(losses) == math.ceil(2 * per_epoch / 2) and all(math.isfinite(x) for x in losses)
    assert "'epoch': 1," in capsys.readouterr().out.splitlines()[-1]


def test_train_hf_trainer_logs_window_metrics(make_build, examples_on_path, tmp_path):
    import train_hf_trainer

    path, _ = make_build(n_packs=30, capacity=64)
    logs = train_hf_trainer.main(
        [str(path), "--output", str(tmp_path / "out"), "--steps", "2", "--accum", "2", "--vocab-size", "128"]
    )
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    assert all(log["input_tokens"] > log["target_tokens"] > 0 and log["segments"] >= 4 for log in logs)
    del sys.modules["train_hf_trainer"]
