"""Peak memory and time of one Trainer step on packed rows: the chunked loss against the model's own.

    .venv/bin/python bench/trainer_bench.py                       # capacity 4096, 3 rounds
    .venv/bin/python bench/trainer_bench.py --capacity 2048 --rounds 5

Each row is one process (its peak RSS, `ru_maxrss`, is its own) running one optimizer step of a
tiny random Qwen3 (1 layer, hidden 32) with Qwen's vocabulary (V = 151,936) on two packs of
`--capacity` tokens (`per_device_train_batch_size=2`, so one micro-batch of 2 x capacity tokens):

    plain loop        the README's loop: model.model(...) hidden states, chunked_token_loss_sum, backward
    trainer chunked   PackedTrainer (default loss="chunked"): the same loss inside transformers.Trainer
    trainer model     PackedTrainer(loss="model"): the model's own loss, with the [T, V] logits; the peer,
                      what transformers.Trainer and TRL's SFTTrainer do without packtool

Rows alternate within each round (a shared machine's load then falls on all of them alike); the table
gives each row's median peak RSS and step time, and the median over rounds of each row's ratio to the
plain loop's in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151_936
ROWS = ("plain loop", "trainer chunked", "trainer model")

# One row in a fresh process: argv = build, output folder, row name.
RUN = """
import json, resource, sys, time
import torch, transformers
from packtool.loader import PackedDataset, chunked_token_loss_sum
from packtool.loader.collate import collate
from packtool.loader.hf import PackedTrainer, model_inputs, trainer_dataset

build, output, row = sys.argv[1:4]
config = transformers.Qwen3Config(vocab_size=%(vocab)d, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=65536, use_cache=False)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
model = transformers.Qwen3ForCausalLM(config)
started = time.perf_counter()
if row == "plain loop":
    mb = collate(list(PackedDataset(build, shuffle=False)))
    hidden = model.model(**model_inputs(mb, model)).last_hidden_state
    loss_sum, n = chunked_token_loss_sum(hidden, model.lm_head.weight, mb.labels)
    (loss_sum / n).backward()
    loss = float(loss_sum) / n
else:
    args = transformers.TrainingArguments(output_dir=output, max_steps=1, per_device_train_batch_size=2,
        learning_rate=0.0, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    loss_from = "chunked" if row == "trainer chunked" else "model"
    trainer = PackedTrainer(model=model, args=args, train_dataset=trainer_dataset(build, args), loss=loss_from)
    trainer.train()
    loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
seconds = time.perf_counter() - started
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "seconds": seconds,
                  "loss": loss}))
"""


def make_build(folder: Path, capacity: int) -> Path:
    """Two packs of `capacity` tokens, each four documents (targets after a short prompt)."""
    import numpy as np

    from packtool.labels import labels_for

    sys.path.insert(0, str(REPO / "tests" / "loader"))
    from conftest import _row, write_build  # the loader tests' writer of a build without a tokenizer

    rng = np.random.default_rng(0)
    packs = []
    for p in range(2):
        cu = np.array([0, capacity // 4, capacity // 2, 3 * capacity // 4, capacity])
        ids = rng.integers(1, 4000, size=capacity).astype(np.int32)
        labels = labels_for(ids, rng.random(capacity) >= 0.1, cu)
        packs.append(_row(ids, labels, cu, cu, p))
    return write_build(folder / "build", packs, capacity=capacity, packs_per_shard=2, row_group_size=2)


def run_row(build: Path, output: Path, row: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", RUN % {"vocab": VOCAB}, str(build), str(output), row],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2", "TRANSFORMERS_VERBOSITY": "error"},
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{row}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build = make_build(Path(tmp), args.capacity)
        runs: dict[str, list[dict]] = {row: [] for row in ROWS}
        for round_ in range(args.rounds):
            order = ROWS if round_ % 2 == 0 else tuple(reversed(ROWS))
            for row in order:
                runs[row].append(run_row(build, Path(tmp) / "run", row))
    print(f"one step, V = {VOCAB:,}, 2 packs x {args.capacity} tokens, {args.rounds} rounds (medians)\n")
    print(f"{'row':<17} {'peak RSS GB':>11} {'x plain':>8} {'step s':>7} {'x plain':>8} {'loss':>10}")
    plain = runs["plain loop"]
    for row in ROWS:
        rss = statistics.median(r["peak_rss"] for r in runs[row]) / 1e9
        seconds = statistics.median(r["seconds"] for r in runs[row])
        rss_ratio = statistics.median(r["peak_rss"] / p["peak_rss"] for r, p in zip(runs[row], plain))
        time_ratio = statistics.median(r["seconds"] / p["seconds"] for r, p in zip(runs[row], plain))
        loss = runs[row][0]["loss"]
        print(f"{row:<17} {rss:>11.2f} {rss_ratio:>8.2f} {seconds:>7.2f} {time_ratio:>8.2f} {loss:>10.6f}")


if __name__ == "__main__":
    main()
