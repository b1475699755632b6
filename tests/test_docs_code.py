"""Every Python block of README.md and docs/*.md runs in a test, and the documented training loops keep packed
documents apart on a model whose config asks for a KV cache.

A tiny Qwen3 with `use_cache=True` (Qwen3's own default, and what real checkpoints ship) is the model the
blocks get: fed by hand (`model.model(input_ids=..., position_ids=...)`) it builds a cache and no block
mask, and every packed document attends to the ones before it. A recorder on `model.model` runs each
packed call's documents alone and compares their hidden states and log-prob sums.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import QUICKSTART, REPO

from packtool.format import read_manifest

torch = pytest.importorskip("torch", reason="the documented loops need the loader extra (torch)")
transformers = pytest.importorskip("transformers", reason="the documented loops run a transformers model")

PYTHON_FENCES = ("python", "py", "python3")


@dataclass(frozen=True, slots=True)
class Block:
    key: str  # "docs/loader.md: The loop" (heading), " (2)" after it for a second block under one heading
    code: str


def python_blocks() -> list[Block]:
    """Every fenced Python block of README.md and docs/*.md, named by its file and the heading above it."""
    blocks: list[Block] = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        heading, seen = "(top)", {}
        lines = path.read_text(encoding="utf-8").splitlines()
        fence: str | None = None
        body: list[str] = []
        for line in lines:
            if fence is None:
                if re.match(r"#{1,6} ", line):
                    heading = line.lstrip("#").strip()
                elif line.startswith("```"):
                    fence, body = line[3:].strip().lower(), []
            elif line.startswith("```"):
                if fence in PYTHON_FENCES:
                    name = f"{path.relative_to(REPO)}: {heading}"
                    seen[name] = seen.get(name, 0) + 1
                    key = name if seen[name] == 1 else f"{name} ({seen[name]})"
                    blocks.append(Block(key, "\n".join(body) + "\n"))
                fence = None
            else:
                body.append(line)
    return blocks


SFT_LOOPS = ("README.md: A training loop", "docs/loader.md: The loop")
DPO_LOOPS = ("docs/loader.md: Preference pairs and completion groups (DPO, RL)", "docs/pairs.md: Loader")
RUN_ELSEWHERE = {
    "README.md: Hugging Face Trainer and TRL": (
        "tests/test_readme.py",
        "test_the_readme_trainer_block_trains_on_the_quickstart",
    ),
    "docs/format.md: Recomputing `pack_hash`": (
        "tests/test_format_doc.py",
        "test_the_documented_pack_hash_recipe_recomputes_the_stored_hashes",
    ),
    # run beside the positions it shows, against the models' own get_rope_index
    "docs/vision.md: Positions (`packtool.vision.positions`)": (
        "tests/vision/test_positions.py",
        "test_the_documented_example_runs",
    ),
}
PYTHON_API = "README.md: From Python (notebooks)"
# Blocks that are deliberately not runnable, each with the reason (none today: every block runs).
FRAGMENTS: dict[str, str] = {}


def test_every_python_block_is_run_or_listed_as_a_fragment():
    found = {block.key for block in python_blocks()}
    listed = {*SFT_LOOPS, *DPO_LOOPS, *RUN_ELSEWHERE, PYTHON_API, *FRAGMENTS}
    assert not found - listed, f"Python blocks no test runs: {sorted(found - listed)}; run them here or list them"
    assert not listed - found, f"listed blocks that no longer exist: {sorted(listed - found)}"


@pytest.mark.parametrize("key", sorted(RUN_ELSEWHERE))
def test_blocks_run_elsewhere_have_their_test(key):
    path, name = RUN_ELSEWHERE[key]
    assert f"def {name}(" in (REPO / path).read_text(encoding="utf-8"), f"{key}: {path}::{name} is gone"


def test_a_block_under_an_unlisted_heading_is_found(tmp_path, monkeypatch):
    """The inventory sees a new block (```py fence, second block under a heading): it fails the listing test."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "README.md").write_text("# Top\n\n```python\nx = 1\n```\n", encoding="utf-8")
    (docs / "new.md").write_text("## Recipe\n\n```bash\nls\n```\n```py\na = 1\n```\n\n```python\nb = 2\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert [b.key for b in python_blocks()] == ["README.md: Top", "docs/new.md: Recipe", "docs/new.md: Recipe (2)"]
    assert [b.code for b in python_blocks()] == ["x = 1\n", "a = 1\n", "b = 2\n"]


# What the blocks leave to the reader. The block runs in a namespace of only these names, so a block that
# forgets an import fails here as it would for a reader pasting it.
PREAMBLE = """
import itertools
import json
import sys

import torch
import transformers

from packtool.loader.loss import chunked_token_loss_sum


def tiny_qwen3():  # use_cache=True: Qwen3's default and real checkpoints'; a feed must turn the cache off
    config = transformers.Qwen3Config(
        vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, use_cache=True)
    return transformers.Qwen3ForCausalLM(config)


class Alone:
    # Each packed call of model.model (the guard's two included): every document run alone, compared.
    def __init__(self, model, calls):
        self.model, self.left, self.busy = model, calls, False
        self.calls, self.documents, self.hidden, self.per_target, self.errors = 0, 0, 0.0, 0.0, []
        model.model.register_forward_hook(self.compare, with_kwargs=True)

    def compare(self, module, args, kwargs, output):
        if self.busy or self.left == 0:
            return
        self.left -= 1
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None or positions is None:
            self.errors.append(f"model.model called with {sorted(kwargs)}: no input_ids and position_ids")
            return
        row = positions.reshape(-1, ids.shape[-1])[0]  # [1, T] or mRoPE [4, 1, T]: text positions first
        bounds = [*torch.nonzero(row == 0).flatten().tolist(), ids.shape[-1]]
        weight = self.model.lm_head.weight
        self.busy = True
        try:
            with torch.no_grad():
                for lo, hi in itertools.pairwise(bounds):
                    alone = module(input_ids=ids[:, lo:hi], use_cache=False).last_hidden_state
                    packed = output.last_hidden_state[:, lo:hi].detach()
                    labels = ids[:, lo:hi].clone()
                    labels[:, 0] = -100  # each document's own next tokens, the first has no predecessor
                    a, n = chunked_token_loss_sum(alone, weight, labels)
                    p, _ = chunked_token_loss_sum(packed, weight, labels)
                    self.hidden = max(self.hidden, float((alone - packed).abs().max()))
                    self.per_target = max(self.per_target, abs(float(a) - float(p)) / max(int(n), 1))
                    self.documents += 1
        finally:
            self.busy = False
        self.calls += 1

    def report(self):
        return {"calls": self.calls, "documents": self.documents, "hidden": self.hidden,
                "per_target": self.per_target, "errors": self.errors}


torch.manual_seed(0)
model = tiny_qwen3().train()
ref_model = tiny_qwen3().eval()
recorders = {"policy": Alone(model, calls=6), "reference": Alone(ref_model, calls=4)}
start = [p.detach().clone() for p in model.parameters()]
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
accum, steps, logged, checkpoint = 2, 2, [], {}
given = dict(model=model, ref_model=ref_model, optimizer=optimizer, accum=accum, steps=steps,
             log=logged.append, checkpoint=checkpoint)
code = open(sys.argv[1], encoding="utf-8").read()
exec(compile(code, sys.argv[1], "exec"), {"__name__": "__main__", **given})
moved = max(float((p.detach() - s).abs().max()) for p, s in zip(model.parameters(), start))
print(json.dumps({
    "isolation": {name: r.report() for name, r in recorders.items()},
    "moved": moved,
    "windows": len(logged),
    "targets": sum(m["target_tokens"] for m in logged),
    "state": checkpoint.get("data"),
}))
"""

# float32: the packed and alone forwards differ by rounding (measured 7e-7 on the hidden states and 8e-7 a target);
# a document that sees the ones before it (the hand-fed loops) moved them by 1.5-2.0 and 1e-2.
HIDDEN_TOLERANCE = 1e-4
PER_TARGET_TOLERANCE = 1e-5


def _pairs(n: int) -> list[dict]:
    """TRL conversational pairs, some with an earlier exchange in the prompt."""
    rows = []
    for i in range(n):
        a, b = 3 * i + 1, 7 * i + 2
        prompt = [{"role": "user", "content": f"Question {i}: what is {a} plus {b}?"}]
        if i % 3 == 0:
            prompt = [
                {"role": "user", "content": f"Hello, I have a sum for you (number {i})."},
                {"role": "assistant", "content": "Sure, go ahead."},
                *prompt,
            ]
        chosen = [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        rejected = [{"role": "assistant", "content": f"I think it is {a + b + 1}, or maybe {a * b}."}]
        rows.append({"id": f"pair-{i}", "prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


@pytest.fixture(scope="module")
def docs_workdir(tmp_path_factory) -> Path:
    """A folder as the docs' commands leave it: out/quickstart (40 records a source) and out/dpo."""
    folder = tmp_path_factory.mktemp("docs-code")

    def build(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "packtool", "build", *args, "-q"], cwd=folder, capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"packtool build {' '.join(args)} failed: {done.stderr.decode()[-2000:]}")

    build(str(REPO / "configs" / "quickstart.yaml"), "-o", "out/quickstart", "--max-samples", "40")
    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _pairs(40)), encoding="utf-8")
    config = {
        "sources": [{"name": "pairs", "path": str(data), "format": "preference", "fields": {"id": "id"}}],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "template": "model",
        "capacity": 512,
        "output": str(folder / "out" / "dpo"),
    }
    (folder / "dpo.yaml").write_text(json.dumps(config), encoding="utf-8")
    build("dpo.yaml")
    return folder


def run_block(key: str, folder: Path, name: str) -> dict:
    """The block as written, after the preamble, from `folder`; its JSON summary."""
    (block,) = [b for b in python_blocks() if b.key == key]
    (folder / f"{name}.py").write_text(block.code, encoding="utf-8")
    (folder / "preamble.py").write_text(PREAMBLE, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(
        [sys.executable, "preamble.py", f"{name}.py"], cwd=folder, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]  # no traceback at exit from the read-ahead threads
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_isolated(report: dict, model: str) -> None:
    seen = report["isolation"][model]
    assert not seen["errors"], seen["errors"]
    assert seen["calls"] >= 2 and seen["documents"] >= 4, f"{model}: too few packed calls compared: {seen}"
    assert seen["hidden"] <= HIDDEN_TOLERANCE, f"{model}: a packed document's hidden states differ alone: {seen}"
    assert seen["per_target"] <= PER_TARGET_TOLERANCE, f"{model}: a packed document's log-prob sum differs: {seen}"


def distinct(keys: tuple[str, ...]) -> list[str]:
    """The blocks among `keys` whose code differs (the README and docs/loader.md show one loop twice: it runs
    once, ~35 s of CI; a copy that drifts from the first runs on its own)."""
    codes = {block.key: block.code for block in python_blocks()}
    first: dict[str, str] = {}
    for key in keys:
        first.setdefault(codes.get(key, key), key)
    return list(first.values())


@pytest.mark.parametrize("key", distinct(SFT_LOOPS))
def test_documented_sft_loop_trains_three_epochs_packed_as_alone(key, docs_workdir, tmp_path):
    """The SFT loop as written: three whole epochs, each document's loss the same packed as alone."""
    (tmp_path / "out").symlink_to(docs_workdir / "out")
    result = run_block(key, tmp_path, "sft")
    assert_isolated(result, "policy")
    built = read_manifest(docs_workdir / "out" / "quickstart")
    # three whole epochs (every pack's targets three times; one rank leaves none out), then the loop ends
    assert result["targets"] == 3 * built.raw["stats"]["targets"] and result["windows"] >= 3
    assert result["state"]["epoch"] == 2  # a state taken at an epoch's end names that epoch
    assert result["moved"] > 0


@pytest.mark.parametrize("key", distinct(DPO_LOOPS))
def test_documented_dpo_loop_scores_packed_segments_as_alone(key, docs_workdir, tmp_path):
    """The DPO loop as written: policy and reference log-prob sums the same packed as alone; the policy trains."""
    (tmp_path / "out").symlink_to(docs_workdir / "out")
    result = run_block(key, tmp_path, "dpo")
    assert_isolated(result, "policy")
    assert_isolated(result, "reference")
    assert result["moved"] > 0


# ---- the guard the documented loops run: check_isolation(model, forward=the loop's own forward) ----


def _guard_model():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        use_cache=True,
    )
    return transformers.Qwen3ForCausalLM(config)


def test_the_guard_passes_the_documented_forward_and_stops_a_hand_fed_one():
    from packtool.errors import IsolationError
    from packtool.loader.hf import check_isolation, model_inputs

    model = _guard_model()

    def documented(model, mb):
        return model.model(**model_inputs(mb, model)).last_hidden_state

    def by_hand(model, mb):  # what docs/loader.md and docs/pairs.md fed before: the config's KV cache stays on
        return model.model(input_ids=mb.input_ids, position_ids=mb.position_ids).last_hidden_state

    assert check_isolation(model, forward=documented) == 0.0
    assert model.training  # the guard leaves the mode it found
    with pytest.raises(IsolationError, match=r"layer 0 \(full_attention\).*fix: feed packtool.loader.hf.model_inputs"):
        check_isolation(model, forward=by_hand)


def test_the_guard_refuses_a_forward_that_is_not_the_packed_row():
    from packtool.errors import IsolationError
    from packtool.loader.boundaries import position_ids_only
    from packtool.loader.hf import check_isolation, model_inputs

    model = _guard_model()
    with pytest.raises(IsolationError, match=r"returned shape \(23, 32\) for a packed row of \(1, 23\)"):
        check_isolation(model, forward=lambda m, mb: m.model(**model_inputs(mb, m)).last_hidden_state[0])
    with pytest.raises(IsolationError, match="forward returned BaseModelOutputWithPast; it must return"):
        check_isolation(model, forward=lambda m, mb: m.model(**model_inputs(mb, m)))  # .last_hidden_state left out
    with pytest.raises(TypeError, match="feed= or forward=, not both"):
        check_isolation(model, feed=position_ids_only, forward=lambda m, mb: m(**model_inputs(mb, m)).logits)


def test_the_python_api_block_builds_from_a_file_and_from_a_dict(tmp_path):
    """Run where the README's commands run: a folder holding configs/ (the quickstart and its data)."""
    import shutil

    shutil.copytree(QUICKSTART, tmp_path / "configs" / "quickstart")
    shutil.copy(QUICKSTART.parent / "quickstart.yaml", tmp_path / "configs" / "quickstart.yaml")
    [block] = [b for b in python_blocks() if b.key == PYTHON_API]
    script = tmp_path / "api.py"
    script.write_text(block.code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    notebook, docs = done.stdout.strip().splitlines()
    assert notebook.endswith(f"packs in {tmp_path / 'out' / 'notebook'}")
    assert docs.endswith(f"packs in {tmp_path / 'out' / 'docs'}")
    assert read_manifest(tmp_path / "out" / "docs").capacity == 512
