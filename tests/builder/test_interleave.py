"""mixing.interleave: every window of K consecutive packs holds the mix, in the build's order and in every
order the loader reads (whole windows shuffled), and `packtool stats` shows the worst window."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from support import QUICKSTART, three_real_sources

from packtool.builder import build
from packtool.builder.mixing import interleave_order
from packtool.cli import main
from packtool.commands.stats import format_stats
from packtool.config import ConfigError, load_config
from packtool.errors import BuildError
from packtool.format import Interleaving, read_manifest
from packtool.loader.dataset import PackedDataset
from packtool.loader.schedule import PlanOptions, epoch_order, plan_epoch, positions_to_flat
from packtool.shards import locate
from packtool.summaries import summarize, window_mix


def test_window_mix_example():
    mix = window_mix(np.array([[4, 0], [0, 4], [6, 2], [2, 0], [3, 3]]), 2)
    assert mix.windows == 2 and mix.share.tolist() == [0.625, 0.375]
    assert np.allclose(mix.deviation, [0.175, 0.175]) and mix.worst.tolist() == [1, 1]


def test_interleave_order_example():
    amounts = np.array([[6, 0], [6, 0], [6, 0], [0, 2], [0, 2], [0, 2]])
    order = interleave_order(amounts, 2)
    assert order.tolist() == [0, 3, 1, 4, 2, 5]
    assert window_mix(amounts[order], 2).deviation.max() == 0.0
    assert window_mix(amounts, 2).deviation.max() == 0.75  # as packed: a window of the 0.25 source alone


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(1, 6), st.integers(1, 8), st.integers(0, 99))
def test_equal_packs_of_whole_shares_make_every_window_exact(per_window, windows, size, seed):
    """Pure packs of one size, each source a whole number of packs per window: every window is the mix."""
    rng = np.random.default_rng(seed)
    window = sum(per_window)
    sources = rng.permutation(np.repeat(np.arange(len(per_window)), np.array(per_window) * windows))
    amounts = np.zeros((len(sources), len(per_window)), np.int64)
    amounts[np.arange(len(sources)), sources] = size
    order = interleave_order(amounts, window)
    assert sorted(order.tolist()) == list(range(len(sources)))
    assert window_mix(amounts[order], window).deviation.max() == pytest.approx(0.0)


def _unit_rows(n_packs: int, window: int, groups_per_unit: int) -> list[int]:
    """Row groups as a build writes them under mixing.interleave: whole windows, the last one maybe partial."""
    per_unit = window * groups_per_unit
    return [per_unit] * (n_packs // per_unit) + ([n_packs % per_unit] if n_packs % per_unit else [])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3).flatmap(lambda k: st.lists(st.lists(st.integers(0, 30), min_size=k, max_size=k), min_size=1)),
    st.sampled_from([2, 4, 6]),
    st.integers(1, 3),
    st.integers(0, 2**32),
    st.integers(0, 5),
)
def test_every_window_the_loader_reads_is_one_the_build_measured(rows, window, groups, seed, epoch):
    """Across seeds, epochs and world sizes, positions [jK, (j+1)K) of the loader's order are a window of the
    build, so their mix is within what the build measured; a step of K packs (packs_per_step) is one window."""
    amounts = np.array(rows, dtype=np.int64)
    built = amounts[interleave_order(amounts, window)]
    measured = window_mix(built, window)
    unit_rows = _unit_rows(len(built), window, groups)
    order = epoch_order(unit_rows, seed, epoch, True, window)
    flat = positions_to_flat(unit_rows, order, 0)
    assert sorted(flat.tolist()) == list(range(len(built)))
    full = measured.windows * window
    assert (flat[:full] // window == np.repeat(flat[:full:window] // window, window)).all()  # whole windows
    assert (flat[full:] >= full).all()  # the partial window last
    read = window_mix(built[flat], window)
    assert (read.deviation <= measured.deviation + 1e-12).all()
    tokens = np.full(len(built), 8, np.int64)
    for world in (1, 2, window):
        options = PlanOptions(world, capacity=64, balance="attention", packs_per_step=window)
        plan = plan_epoch(unit_rows, order, 0, options, lambda: (tokens, tokens * 8))
        for step in range(plan.rounds):
            packs = flat[plan.bounds[step] : plan.bounds[step + 1]]
            if len(packs) == window:
                assert len(set((packs // window).tolist())) == 1


def test_window_order_refuses_row_groups_that_split_windows():
    from packtool.errors import DatasetError

    with pytest.raises(DatasetError, match="row group 0 holds 3 packs"):
        epoch_order([3, 4, 4], seed=0, epoch=0, shuffle=True, window=2)


def _chat(n: int, words: int, prefix: str) -> list[dict]:
    return [
        {
            "id": f"{prefix}{i}",
            "messages": [
                {"role": "user", "content": f"{prefix} question {i}?"},
                {"role": "assistant", "content": " ".join(["answer"] * (words + i % 9))},
            ],
        }
        for i in range(n)
    ]


@pytest.fixture
def three_sources(tmp_path, write_config, write_jsonl):
    """Three small sources of different lengths on the quickstart tokenizer; `make(**settings)` builds them."""
    write_jsonl(_chat(240, 8, "a"), "a.jsonl")
    write_jsonl(_chat(120, 30, "b"), "b.jsonl")
    write_jsonl([{"text": " ".join(["word"] * (20 + i % 13))} for i in range(150)], "c.jsonl")

    def make(name: str = "out", **settings):
        raw = {
            "sources": [
                {"name": "a", "path": "a.jsonl", "format": "messages", "fields": {"id": "id"}},
                {"name": "b", "path": "b.jsonl", "format": "messages", "fields": {"id": "id"}},
                {"name": "c", "path": "c.jsonl", "format": "text"},
            ],
            "tokenizer": str(QUICKSTART / "tokenizer"),
            "capacity": 128,
            "output": name,
            "rows_per_shard": 32,
            "row_group_rows": 16,
            **settings,
        }
        return load_config(write_config(raw, f"{name}.yaml"))

    return make


def _pack_amounts(folder, names):
    """Tokens of each source in every pack, in the build's order (read from the shards, not the stats)."""
    rows = []
    for shard in read_manifest(folder).shards:
        for row in pq.read_table(shard.file, columns=["sources", "doc_cu_seqlens"]).to_pylist():
            lengths = np.diff(row["doc_cu_seqlens"])
            rows.append([int(lengths[np.array(row["sources"]) == n].sum()) for n in names])
    return np.array(rows, dtype=np.int64)


def test_an_interleaved_build_holds_the_mix_in_every_window_and_every_loader_step(three_sources, tmp_path):
    window, tolerance = 8, 0.12
    mixing = {"by": "tokens", "interleave": {"window": window, "tolerance": tolerance}}
    plain = build(three_sources("plain", mixing={"by": "tokens"})).manifest
    manifest = build(three_sources("mixed", mixing=mixing)).manifest
    assert manifest["mixing"]["interleave"] == {"window": window, "tolerance": tolerance, "unit": "tokens"}
    # the same packs in another order: packing efficiency is untouched
    assert manifest["stats"]["packs"] == plain["stats"]["packs"]
    assert manifest["stats"]["token_efficiency"] == plain["stats"]["token_efficiency"]
    assert "interleave" not in plain["mixing"] and "interleave" not in plain["stats"]

    folder = tmp_path / "mixed"
    names = ["a", "b", "c"]
    amounts = _pack_amounts(folder, names)
    block = manifest["stats"]["interleave"]
    assert block["within_tolerance"] and block["worst_deviation"] <= tolerance
    assert block["windows"] == len(amounts) // window
    assert np.isclose(window_mix(amounts, window).deviation.max(), block["worst_deviation"], atol=1e-6)
    assert window_mix(_pack_amounts(tmp_path / "plain", names), window).deviation.max() > 2 * tolerance

    share = amounts.sum(axis=0) / amounts.sum()
    # (shard file, row) -> the pack's index in the build's order (repeated samples can make equal pack hashes)
    flat = {(s.file.name, row): None for s in read_manifest(folder).shards for row in range(s.rows)}
    flat = {key: index for index, key in enumerate(flat)}
    for world in (1, 2, 4):
        ranks = [PackedDataset(folder, rank=r, world_size=world, seed=3) for r in range(world)]
        for epoch in range(2):
            steps: dict[int, list[np.ndarray]] = {}
            for ds in ranks:
                ds.set_epoch(epoch)
                for pack in ds:  # packs mode: round k = positions [k W, k W + W); a step is K / W rounds
                    steps.setdefault(pack.step // (window // world), []).append(amounts[flat[pack.shard, pack.row]])
            for packs in steps.values():
                if len(packs) == window:
                    mix = np.sum(packs, axis=0) / np.sum(packs)
                    assert np.abs(mix - share).max() <= tolerance + 1e-9


def test_an_unreachable_tolerance_fails_in_one_line_before_any_shard(three_sources, tmp_path):
    config = three_sources(mixing={"interleave": {"window": 2, "tolerance": 0.01}})
    with pytest.raises(BuildError, match=r"mixing\.interleave: source '\w' is 0\.\d+ off its share .* in window \d+"):
        build(config)
    assert not list(tmp_path.glob("out/*.parquet"))


def test_a_window_larger_than_the_build_is_an_error(three_sources):
    config = three_sources(mixing={"interleave": {"window": 512}}, rows_per_shard=512, row_group_rows=512)
    with pytest.raises(BuildError, match=r"window 512 > the build's \d+ packs"):
        build(config)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mixing": {"interleave": {"window": 3}}}, "window: 3 must divide row_group_rows 16 .* set row_group_rows"),
        ({"mixing": {"interleave": {"tolerance": 0.1}}}, r"mixing\.interleave\.window: is required"),
        ({"mixing": {"interleave": {"window": 0}}}, r"window: must be between 1"),
        ({"mixing": {"interleave": {"window": 4, "tolerance": 2}}}, r"tolerance: must be between 0"),
        ({"mixing": {"interleave": {"window": 4, "unit": "bytes"}}}, r"unit: 'bytes' is not one of"),
        ({"mixing": {"interleave": {"window": 4, "size": 2}}}, r"interleave\.size: unknown key"),
        ({"mixing": {"interleave": {"window": 4}}, "packing": "sequential"}, "packing 'sequential' keeps its own"),
    ],
)
def test_config_errors(three_sources, settings, message):
    with pytest.raises(ConfigError, match=message):
        three_sources(**settings)


@pytest.mark.parametrize(
    ("settings", "unit"),
    [
        ({}, "tokens"),
        ({"by": "samples"}, "samples"),
        ({"by": "tokens"}, "tokens"),
        ({"unit": "target_tokens"}, "target_tokens"),
    ],
)
def test_the_unit_defaults_to_the_mix_s(three_sources, settings, unit):
    by = {"by": settings["by"]} if "by" in settings else {}
    interleave = {"window": 4, **({"unit": settings["unit"]} if "unit" in settings else {})}
    config = three_sources(mixing={**by, "interleave": interleave})
    assert config.mixing.interleave == Interleaving(4, 0.05, unit)


def test_the_unit_of_quotas_is_the_default(tmp_path, write_config, write_jsonl):
    data = write_jsonl([{"text": "hello"}])
    source = {"name": "a", "path": str(data), "format": "text", "quota": {"target_tokens": 10}}
    raw = {"sources": [source], "tokenizer": str(QUICKSTART / "tokenizer"), "capacity": 64, "output": "out"}
    config = load_config(write_config({**raw, "mixing": {"interleave": {"window": 4}}}))
    assert config.mixing.interleave == Interleaving(4, 0.05, "target_tokens")


def test_stats_prints_each_source_s_worst_window(three_sources, tmp_path):
    build(three_sources(mixing={"interleave": {"window": 16, "tolerance": 0.2}}))
    result = CliRunner().invoke(main, ["stats", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "interleave: windows of 16 packs, shares of tokens within 0.2: worst 0." in result.output
    assert ", within (" in result.output
    lines = result.output.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("interleave:")))
    assert lines[header + 1].split() == ["source", "share", "worst", "gap", "window"]
    assert [line.split()[0] for line in lines[header + 2 : header + 5]] == ["a", "b", "c"]
    as_json = json.loads(CliRunner().invoke(main, ["stats", str(tmp_path / "out"), "--json"]).output)
    block = as_json["interleave"]
    assert set(block["sources"]) == {"a", "b", "c"} and block["window"] == 16
    worst = max(s["worst_deviation"] for s in block["sources"].values())
    assert block["worst_deviation"] == worst <= 0.2


def test_a_manifest_with_a_broken_interleave_is_one_line(three_sources, tmp_path):
    from packtool.errors import PackFormatError
    from packtool.format import Manifest

    build(three_sources(mixing={"interleave": {"window": 16, "tolerance": 0.2}}))
    raw = json.loads((tmp_path / "out" / "manifest.json").read_text())
    raw["mixing"]["interleave"]["window"] = "sixteen"
    with pytest.raises(PackFormatError, match=r"mixing\.interleave must be"):
        Manifest.from_dict(raw, tmp_path / "out")


def test_three_real_sources_interleave_within_the_tolerance(tmp_path, write_config):
    """Quotas in target tokens on three real sources (one split into whole-pack documents), windows of 32."""
    raw = three_real_sources(
        {"code": {"target_tokens": 40_000}, "chat": {"target_tokens": 150_000}, "web": {"target_tokens": 90_000}},
        tmp_path / "out",
    )
    raw |= {
        "rows_per_shard": 64,
        "row_group_rows": 32,
        "mixing": {"interleave": {"window": 32, "tolerance": 0.05}},
    }
    manifest = build(load_config(write_config(raw))).manifest
    block = manifest["stats"]["interleave"]
    assert block["unit"] == "target_tokens" and block["within_tolerance"]
    assert block["worst_deviation"] <= 0.05 and block["windows"] == manifest["stats"]["packs"] // 32
    _, stored, files = locate(tmp_path / "out")
    assert summarize(files, stored)["interleave"] == block
    assert "shares of target_tokens within 0.05" in format_stats(manifest["stats"])
    narrow = {**raw, "output": str(tmp_path / "narrow"), "mixing": {"interleave": {"window": 8, "tolerance": 0.05}}}
    with pytest.raises(BuildError, match=r"off its share 0\.\d+ of target_tokens in window"):
        build(load_config(write_config(narrow, "narrow.yaml")))


def test_the_trace_of_every_step_shows_the_mix_the_loader_trained(three_sources, tmp_path):
    """Balanced steps of K packs on 2 ranks over two epochs: `packtool trace` lists the packs each step of
    the loader read, and the step's mix (StepTrace.mix) is within the tolerance."""
    from packtool.commands.lineage import TraceSettings, trace_step
    from packtool.loader.dataset import packed_steps

    window, tolerance = 8, 0.12
    build(three_sources(mixing={"by": "tokens", "interleave": {"window": window, "tolerance": tolerance}}))
    folder = tmp_path / "out"
    options = {"token_budget": 512, "balance": "attention", "packs_per_step": window}
    stats = read_manifest(folder).raw["stats"]
    share = {name: entry["token_share"] for name, entry in stats["sources"].items()}
    total = stats["packs"]
    ranks = [PackedDataset(folder, rank=r, world_size=2, seed=4, **options) for r in range(2)]
    loader: dict[int, list[str]] = {}
    step0 = 0
    for epoch in range(2):
        counts = []
        for ds in ranks:
            ds.set_epoch(epoch)
            steps = list(packed_steps(ds))
            counts.append(len(steps))
            for s, micro_batches in enumerate(steps):
                loader.setdefault(step0 + s, []).extend(h for mb in micro_batches for h in mb.pack_hashes)
        step0 += counts[0]
    settings = TraceSettings(world_size=2, seed=4, epochs=2, **options)
    for step, packs in loader.items():
        trace = trace_step(folder, step, settings)
        assert sorted(p.pack_hash for mb in trace.micro_batches for p in mb.packs) == sorted(packs)
        if len(packs) < window:  # the partial window, trained last in every epoch, is not held to the mix
            windows, partial = divmod(total, window)
            assert len(packs) == partial and step % (windows + 1) == windows  # each epoch's last step
            continue
        mix = trace.mix()
        tokens = sum(entry["tokens"] for entry in mix.values())
        for name, entry in mix.items():
            assert abs(entry["tokens"] / tokens - share[name]) <= tolerance + 1e-6, (step, name)
