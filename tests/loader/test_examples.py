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


def test_train_plain_runs(make_build, examples_on_path):
    import train_plain

    path, _ = make_build(n_packs=30, capacity=64)
    losses = train_plain.main([str(path), "--steps", "2", "--token-budget", "128", "--vocab-size", "128"])
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    balanced = ["--packs-per-step", "4", "--alpha", "32"]
    losses = train_plain.main([str(path), "--steps", "2", "--token-budget", "128", "--vocab-size", "128", *balanced])
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_train_hf_trainer_gets_the_window_count(make_build, examples_on_path, monkeypatch):
    import train_hf_trainer

    seen = []
    original = train_hf_trainer.PackedTrainer.compute_loss

    def spy(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        seen.append((int(num_items_in_batch), int((inputs["labels"][:, 1:] != -100).sum())))
        return original(self, model, inputs, return_outputs, num_items_in_batch)

    monkeypatch.setattr(train_hf_trainer.PackedTrainer, "compute_loss", spy)
    path, _ = make_build(n_packs=30, capacity=64)
    losses = train_hf_trainer.main([str(path), "--steps", "2", "--accum", "2", "--vocab-size", "128"])
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # num_items_in_batch is the target count of the whole accumulation window
    assert [s[0] for s in seen] == [seen[0][1] + seen[1][1]] * 2 + [seen[2][1] + seen[3][1]] * 2
    del sys.modules["train_hf_trainer"]
