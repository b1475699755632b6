"""The loader on a real preference build (DPO demo file, Qwen2.5): whole pairs per micro-batch, and a DPO loss
on a loaded micro-batch equal to the unpacked computation (tiny random Llama, float64)."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support import shared  # noqa: E402
from test_pair_proofs import BETA, naive_logp  # noqa: E402
from test_proofs import VOCAB, alone, packed_forward, tiny_llama  # noqa: E402

from packtool.builder import build  # noqa: E402
from packtool.config import load_config  # noqa: E402
from packtool.errors import PacktoolError  # noqa: E402
from packtool.format import read_manifest  # noqa: E402
from packtool.loader.collate import SEGMENT_COLUMNS  # noqa: E402
from packtool.loader.dataset import PackedDataset, packed_batches  # noqa: E402
from packtool.loader.preference import CHOSEN, REJECTED, count_pairs, dpo_loss, segment_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def dpo_out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dpo_loader")
    config = {
        "sources": [
            {
                "name": "en",
                "path": str(shared("datasets", "llamafactory_dpo_en_demo.json")),
                "format": "preference",
                "max_samples": 16,
            }
        ],
        "tokenizer": str(shared("tokenizers", "qwen2.5")),
        "template": "model",
        "capacity": 512,  # small packs: many pairs are cut, a few dropped, several pairs per micro-batch
        "output": str(folder / "out"),
        "max_reject_share": 1.0,
        "workers": 1,
    }
    (folder / "config.yaml").write_text(json.dumps(config), encoding="utf-8")
    build(load_config(folder / "config.yaml"))
    return folder / "out"


def test_micro_batches_hold_whole_pairs(dpo_out):
    seen: dict[int, int] = {}
    batches = list(packed_batches(PackedDataset(dpo_out, shuffle=False, token_budget=1024)))
    for number, mb in enumerate(batches):
        groups, kinds = mb.segment_groups, mb.segment_kinds
        assert groups.shape == kinds.shape == (mb.cu_seqlens.numel() - 1,)
        for g in groups.unique().tolist():
            members = kinds[groups == g].tolist()
            assert sorted(members) == [CHOSEN, REJECTED], (g, members)
            assert g not in seen, f"group {g} in micro-batches {seen[g]} and {number}"
            seen[g] = number
    manifest = read_manifest(dpo_out).raw
    assert len(seen) == manifest["accounting"]["en"]["pairs"] == sum(count_pairs(mb.segment_kinds) for mb in batches)
    assert len(batches) > 1


def test_segment_columns_survive_dataloader_workers(dpo_out):
    """Segment columns are built on first use from the chunk's row groups; a micro-batch sent from
    a DataLoader worker carries them built, not the row groups behind them."""

    def columns(mbs):  # as text: NaN rewards compare equal
        return [str([getattr(mb, name).tolist() for name in SEGMENT_COLUMNS]) for mb in mbs]

    local = list(packed_batches(PackedDataset(dpo_out, shuffle=False, token_budget=1024)))
    workers = list(packed_batches(PackedDataset(dpo_out, shuffle=False, token_budget=1024, num_workers=2)))
    assert sorted(columns(workers)) == sorted(columns(local))
    sent = pickle.loads(pickle.dumps(local[0]))
    assert columns([sent]) == columns(local[:1])
    assert len(pickle.dumps(local[0].segments)) < 20_000  # the built columns, not the chunk's tokens


def _tiny_ids(mb):
    """The build's Qwen ids folded into the tiny model's vocabulary (the layout and the targets stay as built)."""
    ids = mb.input_ids % VOCAB
    labels = torch.where(mb.labels == -100, mb.labels, mb.labels % VOCAB)
    return replace(mb, input_ids=ids, labels=labels)


def test_dpo_loss_on_a_loaded_micro_batch_equals_the_unpacked_computation(dpo_out):
    mb = _tiny_ids(next(iter(packed_batches(PackedDataset(dpo_out, shuffle=False, token_budget=1024)))))
    model, reference = tiny_llama(seed=0), tiny_llama(seed=1)
    for m in (model, reference):
        m.config.max_position_embeddings = 1024
    with torch.no_grad():
        ref = segment_logprobs(packed_forward(reference, mb), mb).sums
    terms = dpo_loss(segment_logprobs(packed_forward(model, mb), mb).sums, ref, mb, beta=BETA)

    cu = mb.cu_seqlens.tolist()
    segments = [(mb.input_ids[0, a:b].numpy(), mb.labels[0, a:b].numpy()) for a, b in pairwise(cu)]
    groups, kinds = mb.segment_groups.numpy(), mb.segment_kinds.numpy()
    expected = []
    with torch.no_grad():
        for g in sorted(set(groups.tolist())):
            c = int(np.flatnonzero((groups == g) & (kinds == CHOSEN))[0])
            r = int(np.flatnonzero((groups == g) & (kinds == REJECTED))[0])
            pi = [naive_logp(alone(model, segments[s][0]), segments[s][1]) for s in (c, r)]
            rf = [naive_logp(alone(reference, segments[s][0]), segments[s][1]) for s in (c, r)]
            expected.append(-torch.nn.functional.logsigmoid(BETA * ((pi[0] - rf[0]) - (pi[1] - rf[1]))))
    assert len(expected) >= 1
    assert (terms.losses.detach() - torch.stack(expected)).abs().max() < 1e-9


def test_dpo_loss_refuses_a_micro_batch_without_pairs(dpo_out):
    mb = next(iter(packed_batches(PackedDataset(dpo_out, shuffle=False, token_budget=1024))))
    v1 = replace(mb, segments=None)
    with pytest.raises(PacktoolError, match="schema v1"):
        dpo_loss(torch.zeros(3), torch.zeros(3), v1)
