"""`packtool trace` against what the loader actually yields: every step, over epochs, under balance, across a resume."""

import itertools
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import REPO

pytest.importorskip("torch")
from click.testing import CliRunner

from packtool.cli import main
from packtool.commands import lineage
from packtool.commands.lineage import (
    TraceSettings,
    settings_from_checkpoint,
    settings_from_state,
    trace_key,
    trace_step,
)
from packtool.config import parse_config
from packtool.errors import TraceError
from packtool.loader.dataset import DatasetError, PackedDataset, packed_batches, packed_steps

EPOCHS = 3


def traced(path, settings, first, last):
    """{step: {(rank, micro_batch): [pack_hash, ...]}} for steps first..last-1, from the trace."""
    out = {}
    for step in range(first, last):
        trace = trace_step(path, step, settings)
        out[step] = {(mb.rank, mb.micro_batch): [p.pack_hash for p in mb.packs] for mb in trace.micro_batches}
    return out


def run_steps(path, settings):
    """Steps of the whole run from the anchor, from the trace: until it says the run is over."""
    out = {}
    for step in itertools.count(settings.first_step):
        try:
            trace = trace_step(path, step, settings)
        except TraceError as err:
            assert "past the end of the run" in str(err)
            return out
        out[step] = {(mb.rank, mb.micro_batch): [p.pack_hash for p in mb.packs] for mb in trace.micro_batches}
    raise AssertionError("unreachable")


def loader_steps(ranks, epochs, first_step=0, read=None):
    """The same mapping from what each rank's loader yields, epoch after epoch (the first from its position).

    `read(ds)` gives the rest of the dataset's epoch as steps, each a list of micro-batches' pack hashes.
    """
    read = read or (lambda ds: [[list(mb.pack_hashes)] for mb in packed_batches(ds)])  # one micro-batch a step
    out: dict[int, dict] = defaultdict(dict)
    step0 = first_step
    start_epoch = ranks[0].epoch
    for epoch in range(start_epoch, epochs):
        counts = []
        for rank, ds in enumerate(ranks):
            if epoch != start_epoch:
                ds.set_epoch(epoch)
            steps = read(ds)
            counts.append(len(steps))
            for s, micro_batches in enumerate(steps):
                for m, mb in enumerate(micro_batches):
                    out[step0 + s][(rank, m)] = mb
        assert len(set(counts)) == 1  # every rank the same number of steps
        step0 += counts[0]
    return dict(out)


def ranks_of(path, world, **options):
    return [PackedDataset(path, rank=r, world_size=world, **options) for r in range(world)]


@pytest.mark.parametrize(
    "options",
    [{"token_budget": 64}, {"token_budget": 96, "fixed_shape": True}, {"token_budget": 64, "isolate_documents": True}],
    ids=["budget", "fixed", "isolated"],
)
@pytest.mark.parametrize("world", [1, 3])
def test_token_budget_steps_agree_over_three_epochs(make_build, options, world):
    path, _ = make_build(n_packs=47, packs_per_shard=20, row_group_size=3)
    settings = TraceSettings(world_size=world, seed=5, epochs=EPOCHS, **options)
    expected = loader_steps(ranks_of(path, world, seed=5, **options), EPOCHS)
    assert run_steps(path, settings) == expected
    assert len(expected) > 2 * EPOCHS  # several steps per epoch, none empty


@pytest.mark.parametrize("world", [2, 3])
def test_balanced_steps_agree_over_three_epochs(make_build, world):
    path, _ = make_build(n_packs=50, packs_per_shard=20, row_group_size=3)
    options = {"token_budget": 64, "balance": "attention", "packs_per_step": 7, "alpha": 2.0}
    expected = loader_steps(
        ranks_of(path, world, seed=2, **options),
        EPOCHS,
        read=lambda ds: [[list(mb.pack_hashes) for mb in step] for step in packed_steps(ds)],
    )
    traced_steps = run_steps(path, TraceSettings(world_size=world, seed=2, epochs=EPOCHS, **options))
    assert traced_steps == expected
    assert any(len([k for k in step if k[0] == 0]) > 1 for step in expected.values())  # several micro-batches


def test_packs_mode_steps_agree_with_trainer_batches(make_build):
    """Packs mode: a Trainer batches 3 consecutive packs of its rank (hf._Batches) and accumulates 2 batches."""
    path, _ = make_build(n_packs=40, packs_per_shard=15, row_group_size=4)
    hf = pytest.importorskip("packtool.loader.hf", exc_type=ImportError)
    # the trace reads what the trainer writes
    assert (lineage.CHECKPOINT_STATE, lineage.CHECKPOINT_TRAINER) == (hf.STATE_FILE, hf.TRAINER_FILE)
    batches_of = hf._Batches
    batch, accumulation, world = 3, 2, 2

    def read(ds):
        batches = [[p.pack_hash for p in packs] for packs in batches_of(ds, batch, drop_last=False)]
        return [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]

    expected = loader_steps(ranks_of(path, world, seed=1), EPOCHS, read=read)
    settings = TraceSettings(world_size=world, seed=1, epochs=EPOCHS, batch_size=batch, accumulation=accumulation)
    assert run_steps(path, settings) == expected
    last_of_epoch = max(expected)
    assert len(expected[last_of_epoch]) < world * accumulation  # a short last step (20 packs a rank, 6 a step)


def test_resume_under_another_world_size(make_build):
    """4 ranks train 3 steps and stop; 2 ranks resume from the saved state: each part is traced with its settings."""
    path, _ = make_build(n_packs=60, packs_per_shard=20, row_group_size=3)
    budget, stop = 64, 3
    four = ranks_of(path, 4, seed=9, token_budget=budget)
    before: dict[int, dict] = defaultdict(dict)
    streams = [packed_batches(ds) for ds in four]
    for step, mbs in enumerate(itertools.islice(zip(*streams, strict=True), stop)):
        for rank, mb in enumerate(mbs):
            before[step][(rank, 0)] = list(mb.pack_hashes)
    state = json.loads(json.dumps(four[0].state_dict()))
    assert state["position"] > 0 and all(ds.state_dict() == four[0].state_dict() for ds in four)

    two = ranks_of(path, 2, seed=9, token_budget=budget)
    for ds in two:
        ds.load_state_dict(state)
    after = loader_steps(two, EPOCHS, first_step=stop)

    first_part = TraceSettings(world_size=4, seed=9, token_budget=budget, epochs=EPOCHS)
    assert traced(path, first_part, 0, stop) == dict(before)
    second_part = settings_from_state(state, "state", world_size=2, token_budget=budget, epochs=EPOCHS, first_step=stop)
    assert (second_part.epoch, second_part.position, second_part.seed) == (0, state["position"], 9)
    assert run_steps(path, second_part) == after
    with pytest.raises(TraceError, match="before the anchor step 3"):
        trace_step(path, 2, second_part)


def test_a_sample_trains_where_the_loader_reads_it(make_build):
    path, packs = make_build(n_packs=40, packs_per_shard=15, row_group_size=4)
    settings = TraceSettings(world_size=2, seed=4, token_budget=64, epochs=EPOCHS)
    steps = run_steps(path, settings)
    pack = packs[17]
    sample = pack.sample_ids[0]
    seen = sorted(
        (step, rank, m)
        for step, batches in steps.items()
        for (rank, m), hashes in batches.items()
        if pack.pack_hash in hashes
    )
    by_id = trace_key(path, sample, settings)
    by_hash = trace_key(path, pack.pack_hash[:8], settings, kind="pack_hash")
    assert seen
    for trace in (by_id, by_hash):
        assert [(o.step, o.rank, o.micro_batch) for o in trace.occurrences] == seen
        epochs = [o.epoch for o in trace.occurrences]
        assert epochs == sorted(set(epochs))  # at most once an epoch
        assert trace.packs == 1 and {o.pack_hash for o in trace.occurrences} == {pack.pack_hash}
    with pytest.raises(TraceError, match="no pack holds sample id 'nope'"):
        trace_key(path, "nope", settings)


def test_step_lists_samples_with_targets(make_build):
    path, packs = make_build(n_packs=20, packs_per_shard=20, row_group_size=5)
    trace = trace_step(path, 0, TraceSettings(world_size=2, shuffle=False))
    by_hash = {p.pack_hash: p for p in packs}
    assert [(mb.rank, mb.micro_batch) for mb in trace.micro_batches] == [(0, 0), (1, 0)]
    for mb, position in zip(trace.micro_batches, [0, 1], strict=True):
        (seen,) = mb.packs
        pack = by_hash[seen.pack_hash]
        assert (seen.shard, seen.row, seen.position) == ("shard-00000.parquet", position, position)
        assert [s.sample_id for s in seen.samples] == list(pack.sample_ids)
        targets = [int((pack.labels[a:b] != -100).sum()) for a, b in itertools.pairwise(pack.doc_cu_seqlens.tolist())]
        assert [s.targets for s in seen.samples] == targets
        assert [s.tokens for s in seen.samples] == np.diff(pack.doc_cu_seqlens).tolist()
    assert trace.mix() == {
        "synthetic": {
            "tokens": sum(p.n_tokens for mb in trace.micro_batches for p in mb.packs),
            "targets": sum(s.targets for mb in trace.micro_batches for p in mb.packs for s in p.samples),
        }
    }
    only = trace_step(path, 0, TraceSettings(world_size=2, shuffle=False), rank=1)
    assert [mb.rank for mb in only.micro_batches] == [1]


def test_checkpoint_folder_is_an_anchor(make_build, tmp_path):
    path, _ = make_build(n_packs=40)
    checkpoint = tmp_path / "checkpoint-6"
    checkpoint.mkdir()
    ds = PackedDataset(path, world_size=2, seed=3)
    ds.advance(12)  # as PackedTrainer leaves it after 6 steps of one pack per rank
    (checkpoint / "packtool_data.json").write_text(json.dumps(ds.state_dict()))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 6, "train_batch_size": 1}))
    settings = settings_from_checkpoint(checkpoint)
    assert (settings.first_step, settings.position, settings.world_size, settings.seed) == (6, 12, 2, 3)
    resumed = PackedDataset(path, world_size=2, rank=1, seed=3)
    resumed.load_state_dict(ds.state_dict())
    first = next(iter(resumed))
    (mb,) = trace_step(path, 6, settings, rank=1).micro_batches
    assert [p.pack_hash for p in mb.packs] == [first.pack_hash]
    with pytest.raises(TraceError, match=r"no packtool_data\.json"):
        settings_from_checkpoint(tmp_path)
    # a step before the checkpoint: the refusal says how steps count and gives the command that works
    with pytest.raises(TraceError) as refused:
        trace_step(path, 1, settings)
    message = str(refused.value)
    assert "trace steps count from 0: the Trainer's global_step 6 ends with trace step 5" in message
    command = re.search(r"packtool trace (\S+) (--step 1 .*?); a resumed one", message)
    assert command and command.group(1) == str(path), message
    result = CliRunner().invoke(main, ["trace", str(path), *command.group(2).split(), "--json"])
    assert result.exit_code == 0, result.output
    from_start = PackedDataset(path, world_size=2, rank=1, seed=3)
    second = list(itertools.islice(iter(from_start), 2))[1]  # step 1 of a run that never resumed, rank 1
    [rank1] = [mb for mb in json.loads(result.output)["micro_batches"] if mb["rank"] == 1]
    assert [p["pack_hash"] for p in rank1["packs"]] == [second.pack_hash]


def test_cli_step_and_id(make_build):
    path, packs = make_build(n_packs=30)
    common = ["--world-size", "2", "--token-budget", "64", "--epochs", "2", "--seed", "3"]
    result = CliRunner().invoke(main, ["trace", str(path), "--step", "1", *common, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    expected = trace_step(path, 1, TraceSettings(world_size=2, token_budget=64, epochs=2, seed=3))
    assert report == json.loads(json.dumps(expected.as_dict()))
    text = CliRunner().invoke(main, ["trace", str(path), "--id", packs[3].sample_ids[0], *common])
    assert text.exit_code == 0, text.output
    assert "trained 2 time(s)" in text.output and "epoch 1 step" in text.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--step", "1", "--id", "x"], "exactly one of --step N, --id ID, --pack HASH"),
        (["--step", "500"], "step 500 is past the end of the run"),
        (["--step", "0", "--token-budget", "8"], "token_budget 8 < capacity 32"),
        (["--step", "0", "--rank", "2"], "rank 2 is outside world_size 1"),
        (["--pack", "zz"], "is no pack_hash"),
        (["--step", "0", "--epoch", "2"], "anchor epoch 2 is not inside the run's 1 epoch"),
        (["--step", "0", "--batch-size", "2", "--token-budget", "64"], "batch_size is for the packs mode"),
        (["--step", "0", "--seed", "-1"], "seed: must be between 0 and 9,223,372,036,854,775,807"),
        (["--step", "0", "--seed", str(2**64)], "seed: must be between 0 and"),
        (["--step", "0", "--balance", "attention", "--packs-per-step", "2", "--alpha", "nan"], "alpha: must be"),
    ],
)
def test_cli_errors_are_one_line(make_build, args, message):
    path, _ = make_build(n_packs=30)
    result = CliRunner().invoke(main, ["trace", str(path), *args])
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0}, r"lacks \['position', 'seed'\]"),
        ({"epoch": 0, "position": 0, "seed": -1}, r"seed: must be between 0 and"),  # once a numpy traceback
        ({"epoch": 0, "position": 3.7, "seed": 0}, r"position: expected an integer, got float 3.7"),  # once 3
        ({"epoch": 0, "position": 0, "seed": 0, "shuffle": "no"}, r"shuffle: expected true/false"),  # once true
        ([0, 4, 0], r"a loader state is a mapping .*got list"),
    ],
)
def test_bad_state_file_is_one_line(make_build, tmp_path, state, message):
    """The loader's own reader judges the file: what load_state_dict refuses, trace refuses, in one line."""
    path, _ = make_build(n_packs=30)
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(state))
    result = CliRunner().invoke(main, ["trace", str(path), "--step", "0", "--state", str(state_file)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert re.search(f"state.json: {message}", result.output) and len(result.output.strip().splitlines()) == 1
    if isinstance(state, dict):
        with pytest.raises(DatasetError, match=message):
            PackedDataset(path).load_state_dict(state)


def test_trace_refuses_a_state_from_another_build_as_the_loader_does(make_build, tmp_path):
    path, _ = make_build(n_packs=30, seed=1, name="a")
    other, _ = make_build(n_packs=30, seed=2, name="b")
    ds = PackedDataset(path, token_budget=64)
    next(packed_batches(ds))
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(ds.state_dict()))
    args = ["--step", "1", "--token-budget", "64", "--state", str(state_file)]
    traced_here = CliRunner().invoke(main, ["trace", str(path), *args])
    assert traced_here.exit_code == 0, traced_here.output
    header = traced_here.output.splitlines()[0]  # the anchor as settings, not the state's repr
    assert f"position {ds.position}" in header and "ResumeState" not in traced_here.output
    refused = CliRunner().invoke(main, ["trace", str(other), *args])
    assert refused.exit_code == 1 and "its position counts another build's packs" in refused.output
    with pytest.raises(DatasetError, match="its position counts another build's packs"):
        PackedDataset(other, token_budget=64).load_state_dict(ds.state_dict())


def test_a_flag_of_zero_overrides_the_state(make_build, tmp_path):
    """--seed 0 against a state saved under seed 3, mid-epoch: the loader would refuse it, so the trace does,
    instead of dropping the 0 and tracing the state's seed."""
    path, _ = make_build(n_packs=30)
    ds = PackedDataset(path, seed=3)
    ds.advance(4)
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(ds.state_dict()))
    result = CliRunner().invoke(main, ["trace", str(path), "--step", "0", "--state", str(state_file), "--seed", "0"])
    assert result.exit_code == 1 and "cannot resume mid-epoch with a different seed 3 (now 0)" in result.output


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"global_step": "6"}, r"global_step: expected an integer, got str '6'"),  # h37: once passed over: step 0
        ({"global_step": 6.0}, r"global_step: expected an integer, got float 6.0"),
        ({"global_step": True}, r"global_step: expected an integer, got bool True"),
        ({}, r"global_step: missing"),
        ({"global_step": 6, "train_batch_size": "1"}, r"train_batch_size: expected an integer, got str '1'"),
        ({"global_step": 6, "train_batch_size": 0}, r"train_batch_size: must be between 1 and"),
    ],
)
def test_a_checkpoint_whose_trainer_state_is_mistyped_is_one_line(make_build, tmp_path, trainer, message):
    """A global_step the trace cannot read anchored the trace at step 0 instead, and traced other packs."""
    path, _ = make_build(n_packs=40)
    ds = PackedDataset(path, seed=3)
    ds.advance(6)
    (tmp_path / "packtool_data.json").write_text(json.dumps(ds.state_dict()))
    (tmp_path / "trainer_state.json").write_text(json.dumps(trainer))
    with pytest.raises(TraceError, match=f"trainer_state.json: {message}"):
        settings_from_checkpoint(tmp_path)
    result = CliRunner().invoke(main, ["trace", str(path), "--step", "7", "--checkpoint", str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" not in result.output and len(result.output.splitlines()) == 1


def test_locate_names_file_and_line(quickstart_build):
    trace = trace_step(quickstart_build, 2, TraceSettings(world_size=2, token_budget=4096), locate=True)
    samples = [s for mb in trace.micro_batches for p in mb.packs for s in p.samples]
    assert samples and all(s.location and s.location.startswith("quickstart/") for s in samples)
    assert all(s.location.rsplit(":", 1)[1].isdigit() for s in samples if s.location)


def test_a_real_trainer_checkpoint_is_traced(quickstart_build, tmp_path):
    """PackedTrainer (batch 1, accumulation 2): trace steps 0-3 from the start and 2-3 from checkpoint-2 equal the
    micro-batches it trained."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _hf_worker

    def run(name, *args):
        out = str(tmp_path / f"{name}.json")
        return _hf_worker.main([str(quickstart_build), out, "--output", str(tmp_path / name), "--accum", "2", *args])

    trained = run("full", "--steps", "4", "--save-steps", "2")["hashes"][0]  # rank 0's micro-batches, in order
    steps = [trained[2 * s : 2 * s + 2] for s in range(4)]
    from_start = TraceSettings(accumulation=2)
    for s in range(4):
        assert [
            [q.pack_hash for q in mb.packs] for mb in trace_step(quickstart_build, s, from_start).micro_batches
        ] == steps[s]
    anchored = settings_from_checkpoint(tmp_path / "full" / "checkpoint-2")  # accumulation 2: the run's
    assert (anchored.first_step, anchored.position, anchored.batch_size, anchored.accumulation) == (2, 4, 1, 2)
    for s in (2, 3):
        assert [
            [q.pack_hash for q in mb.packs] for mb in trace_step(quickstart_build, s, anchored).micro_batches
        ] == steps[s]
    # --step 1 at checkpoint-2 of a run that never resumed: one line, steps counted from 0, and the command that works
    # no --accumulation 2: the checkpoint holds it (before, the trace planned accumulation 1: other packs)
    checkpoint = ["--checkpoint", str(tmp_path / "full" / "checkpoint-2")]
    refused = CliRunner().invoke(main, ["trace", str(quickstart_build), "--step", "1", *checkpoint])
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert "trace steps count from 0: the Trainer's global_step 2 ends with trace step 1" in refused.output
    command = re.search(r"packtool trace (\S+) (--step 1 .*?); a resumed one", refused.output)
    assert command and command.group(1) == str(quickstart_build), refused.output
    result = CliRunner().invoke(main, ["trace", command.group(1), *command.group(2).split(), "--json"])
    assert result.exit_code == 0, result.output
    assert [[p["pack_hash"] for p in mb["packs"]] for mb in json.loads(result.output)["micro_batches"]] == steps[1]
    shown = CliRunner().invoke(main, ["trace", str(quickstart_build), "--step", "3", *checkpoint])
    assert shown.output.startswith("step 3 (counted from 0, the Trainer's global_step 4 after it; epoch 0)")
    (tmp_path / "full" / "checkpoint-2" / "packtool_trainer.json").write_text('{"gradient_accumulation_steps": 0}')
    bad = CliRunner().invoke(main, ["trace", str(quickstart_build), "--step", "3", *checkpoint])
    assert bad.exit_code == 1 and len(bad.output.strip().splitlines()) == 1, bad.output
    assert 'packtool_trainer.json: expected {"gradient_accumulation_steps": N >= 1}' in bad.output


def test_the_readme_lineage_examples_are_what_the_commands_print(quickstart_build):
    """The README's trace commands, run on the quickstart build, print the lines it shows; its mixing block
    is a valid config with quotas and interleaving."""
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## What did step N train on", 1)[1]
    blocks = section.split("```")
    commands = [line.split()[2:] for line in blocks[1].strip().splitlines()]
    printed = "".join(CliRunner().invoke(main, ["trace", str(quickstart_build), *c[1:]]).output for c in commands)
    shown = [line for line in blocks[3].strip().splitlines() if line != "..."]
    assert shown and all(line in printed.splitlines() for line in shown), printed

    raw = yaml.safe_load(blocks[5].removeprefix("yaml\n"))
    for source in raw["sources"]:
        source["path"] = str(REPO / "configs" / "quickstart" / "chat.jsonl")
    config = parse_config(
        {**raw, "tokenizer": str(REPO / "configs/quickstart/tokenizer"), "capacity": 1024, "output": "out"},
        base_dir=REPO,
    )
    assert [s.plan.quota.amount for s in config.sources] == [2_000_000, 500_000]
    assert config.mixing.interleave is not None and config.mixing.interleave.window == 8
