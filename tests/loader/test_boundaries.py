"""packtool.loader.boundaries: the boundary kwargs each layer type reads, and the one-document-per-row fallback."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from packtool.loader.boundaries import (  # noqa: E402
    layer_kinds,
    model_inputs,
    one_document_per_row,
    seq_idx,
    varlen_kwargs,
)
from packtool.loader.collate import collate  # noqa: E402
from packtool.loader.probe import FAMILIES, family_config  # noqa: E402

# A=[a0 a1 a2] (a0 no target), B=[b0 b1]
ROW = {"input_ids": [11, 12, 13, 21, 22], "labels": [-100, 12, 13, -100, 22], "cu_seqlens": [0, 3, 5]}


def stub(key, backend="sdpa"):
    config = family_config(FAMILIES[key])
    config._attn_implementation = backend
    return SimpleNamespace(config=config)


def test_layer_kinds_of_the_families():
    assert layer_kinds(stub("llama").config) == ("full_attention",) * 2
    assert layer_kinds(stub("mistral").config) == ("sliding_attention",) * 2
    assert layer_kinds(stub("gemma3").config) == ("sliding_attention", "full_attention")
    assert layer_kinds(stub("qwen3_5").config) == ("linear_attention", "full_attention")
    assert layer_kinds(stub("mamba2").config) == ("mamba", "mamba")
    assert layer_kinds(stub("bamba").config) == ("mamba", "full_attention")  # transformers says linear_attention


def test_model_inputs_give_each_family_what_its_layers_read():
    mb = collate([ROW])
    llama = model_inputs(mb, stub("llama"))
    assert set(llama) == {"input_ids", "position_ids", "attention_mask", "use_cache"}
    assert llama["attention_mask"] is None and llama["use_cache"] is False
    assert llama["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # flash backends read the offsets; eager/sdpa build the mask from the restarting positions
    flash = model_inputs(mb, stub("llama", "flash_attention_2"))
    assert flash["cu_seq_lens_q"].tolist() == [0, 3, 5] and flash["max_length_k"] == 3
    # mRoPE: text positions first, then t/h/w, all restarting
    vl = model_inputs(mb, stub("qwen2_vl"))["position_ids"]
    assert vl.shape == (4, 1, 5) and (vl == mb.position_ids).all()
    # Gated DeltaNet layers read cu_seq_lens_q whatever the attention backend
    assert model_inputs(mb, stub("qwen3_5"))["cu_seq_lens_k"].tolist() == [0, 3, 5]
    mamba = model_inputs(mb, stub("mamba2", "eager"))
    assert mamba["seq_idx"].tolist() == [[0, 0, 0, 1, 1]] and mamba["seq_idx"].dtype == torch.int32
    assert seq_idx(mb).tolist() == [[0, 0, 0, 1, 1]]
    assert varlen_kwargs(mb)["cu_seq_q"].tolist() == [0, 3, 5] and varlen_kwargs(mb)["max_q"] == 3


def test_flex_backend_gets_a_document_block_mask():
    from torch.nn.attention.flex_attention import BlockMask

    mask = model_inputs(collate([ROW]), stub("llama", "flex_attention"))["attention_mask"]
    assert isinstance(mask, BlockMask)
    assert mask.mask_mod(0, 0, torch.tensor(3), torch.tensor(2)).item() is False  # b0 cannot see a2
    assert mask.mask_mod(0, 0, torch.tensor(4), torch.tensor(3)).item() is True


def test_one_document_per_row_keeps_targets_and_pads_right():
    batch = one_document_per_row(collate([ROW]))
    assert batch["input_ids"].tolist() == [[11, 12, 13], [21, 22, 0]]
    assert batch["labels"].tolist() == [[-100, 12, 13], [-100, 22, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert int((batch["labels"] != -100).sum()) == int((np.asarray(ROW["labels"]) != -100).sum())


def test_probe_data_needs_a_pack_with_two_documents(make_build):
    from click.testing import CliRunner

    from packtool.cli import main
    from packtool.errors import ProbeError
    from packtool.loader.probe import docs_from_build

    def single_documents(packs):
        packs[:] = [p for p in packs if len(p.cu_seqlens) == 2]

    path, packs = make_build(n_packs=60, alter=single_documents)
    assert packs and all(len(p.cu_seqlens) == 2 for p in packs)
    with pytest.raises(ProbeError, match="none of the first 64 packs holds two documents"):
        docs_from_build(path, 128)
    result = CliRunner().invoke(main, ["audit", "--probe", "llama", "--data", str(path)])
    assert result.exit_code == 1 and "leave out --data" in result.output


def test_probe_data_reads_the_documents_of_a_stream_build(make_build):
    from packtool.loader.probe import docs_from_build

    path, packs = make_build(mode="stream")
    first = next(p for p in packs if len(p.doc_cu_seqlens) >= 3)
    docs = docs_from_build(path, 128)
    assert [len(ids) for ids, _ in docs] == np.diff(first.doc_cu_seqlens).tolist()[: len(docs)]
    assert all(labels[0] == -100 for _, labels in docs)
