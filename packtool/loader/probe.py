"""Is packing isolated in *this* model stack? Run the model and compare (`packtool audit --probe MODEL`).

Packing is only layout if no document can see another. Attention masks are one way a model hears
about boundaries; recurrent layers (Gated DeltaNet, Mamba-2) need them inside their kernels, and
mRoPE models need their positions in another shape. Which combination works is measured here, on
a tiny random-weight model of the same architecture (its layer types, rope and head layout,
smallest sizes), for every attention backend available:

    check            what is compared                                              leak when
    packed_vs_alone  logits of each document in the packed row vs the document run alone   > tol
    perturbation     change one token of document 0: logits of documents 1.. must not move  > tol
    gradients        d(logits of the last document)/d(embeddings) outside that document      > tol (relative)
    loss             the model's own loss with num_items_in_batch vs sum of per-document    > tol
                     token losses / targets (packing must not change the normaliser)

For a row [A | B | C] (cu_seqlens [0, 11, 18, 29]) and a model that leaks, the perturbation
check reads like this: a0..a10 -> a0..a9 a10'; logits of B and C move by 3.9e-02, and the first
decoder layer whose output moved names the culprit (layer 0, linear_attention).

`check_isolation(model)` is the cheap guard the HF trainers run once before training: the
perturbation check only (two forwards on a short packed row, the real model and its real inputs).

tol, relative to the largest value compared: eager and sdpa run in float64, 1e-9 for the
perturbation and gradients (isolated values stay bit-identical) and 1e-6 where kernels of other
shapes recompute (eager's softmax and HF's loss run in float32: 1.4e-7 measured); float32 1e-5 and
1e-4; half precision (flash backends) 5e-3 and 3e-2. A model initialised small leaks small: the
conv layer of LFM2 at initializer_range 0.01 moves other documents' logits by 1.4e-5 of their size
(8.9e-6 absolute in float32, which passed the fixed 1e-4 this limit replaces).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from packtool import hub
from packtool.errors import IsolationError, PacktoolError, ProbeError

try:
    import torch
    import transformers  # noqa: F401  # every probe builds a transformers model
except ImportError as err:  # pragma: no cover - exercised without torch
    raise ImportError("packtool.loader.probe needs PyTorch and transformers: pip install 'packtool[hf]'") from err

from packtool.labels import IGNORE_INDEX
from packtool.loader.boundaries import (
    FEEDS,
    MROPE_MODEL_TYPES,
    RECURRENT_KINDS,
    decoder_layers,
    layer_kinds,
    model_inputs,
    model_layer_kinds,
    one_document_per_row,
)
from packtool.loader.boundaries import uses_mrope as config_uses_mrope
from packtool.loader.collate import MicroBatch, collate
from packtool.loader.loss import token_loss_sum

log = logging.getLogger(__name__)
SKIP_ENV = "PACKTOOL_SKIP_ISOLATION_CHECK"
# not a fix: said so, for whoever wants to measure what contamination costs
SKIPPING = f" ({SKIP_ENV}=1 skips this check and trains with documents that see each other)"
CHECKS = ("packed_vs_alone", "perturbation", "gradients", "loss")
CPU_BACKENDS = ("eager", "sdpa")
# HF compiles flex attention on first use: ~40 s per model on this CPU, and a document BlockMask
# failed in the C++ compile on CPU here; it runs by default where CUDA is, or when asked for.
GPU_BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
DOC_LENGTHS = (11, 7, 13)  # three documents, each longer than the tiny sliding window (4)
GUARD_LENGTHS = (9, 6, 8)
TINY_VOCAB = 128
FIRST_ID = 3  # ids 0-2 are pad/bos/eos in the tiny configs


# How far a value may move, relative to the largest value compared, as (same kernels, recomputed).
# A conv layer initialised at 0.01 (LFM2) moves other documents by 1.4e-5 relative, which passed a
# fixed 1e-4 in float32; in float64 a perturbation leaves isolated values bit-identical, and packed
# vs alone differs by 1.4e-7 at most (eager's softmax and HF's loss run in float32).
RELATIVE = {torch.float64: (1e-9, 1e-6), torch.float32: (1e-5, 1e-4)}


def tolerance(dtype: torch.dtype, *, recomputed: bool = False) -> float:
    """How far a value may move, relative to the values compared. `recomputed`: packed vs alone and the
    loss run other kernel shapes, which round differently (a perturbation leaves isolated values
    bit-identical)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 3e-2 if recomputed else 5e-3
    return RELATIVE.get(dtype, RELATIVE[torch.float32])[recomputed]


def _limit(dtype: torch.dtype, scale: float, *, recomputed: bool = False) -> float:
    """The largest change allowed for values whose largest magnitude is `scale`."""
    if dtype in (torch.float16, torch.bfloat16):
        return max(tolerance(dtype, recomputed=recomputed), HALF_RELATIVE * scale)
    return tolerance(dtype) * scale


def _coarsest(*dtypes: torch.dtype) -> torch.dtype:
    """The least precise of the dtypes a value went through (float64 weights with a float32 scan: float32)."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps if d.is_floating_point else 0.0)


# ---- model families: the tiny configs CI runs (docs/isolation.md's table) ----


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture family: how to build it tiny and what the probe finds on CPU with packtool's inputs."""

    key: str  # `packtool audit --probe KEY`
    label: str
    model_type: str
    settings: Mapping[str, Any] = field(default_factory=dict)  # on top of the tiny sizes
    cpu_verdict: str = "pass"  # with model_inputs on eager/sdpa, no kernels: pass | leak | error
    positions_verdict: str = "pass"  # with restarting position_ids only (what the HF path fed before)
    gpu_route: str = ""  # what keeps documents apart on a GPU (docs table)
    # (transformers release, verdict): cpu_verdict from that release on, where transformers changed
    # what the layer does with packtool's inputs
    cpu_verdict_since: tuple[str, str] | None = None

    def cpu_verdict_for(self, transformers_version: str) -> str:
        """The verdict with model_inputs on CPU under this transformers version."""
        from packaging.version import Version  # a dependency of transformers, which the probe runs

        since = self.cpu_verdict_since
        return (
            since[1] if since is not None and Version(transformers_version) >= Version(since[0]) else self.cpu_verdict
        )

    @property
    def cpu_verdicts(self) -> str:
        """cpu_verdict as the docs table gives it, with the release that changed it."""
        since = self.cpu_verdict_since
        return self.cpu_verdict if since is None else f"{self.cpu_verdict}; {since[1]} from transformers {since[0]}"


_ANY = "any backend; flash reads cu_seq_lens"
_NONE = "one document per row (its layers read no boundary)"
_ALIBI = "one document per row (its ALiBi mask ignores position_ids; no sdpa or flash)"
_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
_MROPE = {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}

FAMILIES: dict[str, Family] = {
    f.key: f
    for f in (
        Family("llama", "Llama", "llama", gpu_route="any backend; flash reads cu_seq_lens"),
        Family("qwen2", "Qwen2", "qwen2", gpu_route="any backend; flash reads cu_seq_lens"),
        Family("qwen3", "Qwen3", "qwen3", gpu_route="any backend; flash reads cu_seq_lens"),
        Family(
            "mistral",
            "Mistral (sliding window)",
            "mistral",
            {"sliding_window": 4},
            gpu_route="any backend; flash reads cu_seq_lens",
        ),
        Family("phi3", "Phi-3", "phi3", gpu_route="any backend; flash reads cu_seq_lens"),
        Family(
            "gemma3",
            "Gemma-3 (sliding + full)",
            "gemma3_text",
            {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
            gpu_route="any backend; flash reads cu_seq_lens",
        ),
        Family(
            "qwen2_vl",
            "Qwen2-VL (mRoPE; images: below)",
            "qwen2_vl",
            _MROPE,
            positions_verdict="leak",
            gpu_route="[4, 1, T] position_ids (model_inputs); flash reads cu_seq_lens",
        ),
        Family(
            "qwen2_5_vl",
            "Qwen2.5-VL (mRoPE; images: below)",
            "qwen2_5_vl",
            _MROPE,
            positions_verdict="leak",
            gpu_route="[4, 1, T] position_ids (model_inputs); flash reads cu_seq_lens",
        ),
        Family(
            "qwen3_vl",
            "Qwen3-VL (interleaved mRoPE; images: below)",
            "qwen3_vl",
            _MROPE,  # 2-D position_ids become its text row too: text alone stays apart, images need model_inputs
            gpu_route="[4, 1, T] position_ids (model_inputs); flash reads cu_seq_lens",
        ),
        Family(
            "qwen3_5",
            "Qwen3.5 text (Gated DeltaNet + full)",
            "qwen3_5_text",
            _HYBRID,
            cpu_verdict="error",
            positions_verdict="leak",
            gpu_route="flash-linear-attention + causal-conv1d read cu_seq_lens",
        ),
        Family(
            "qwen3_next",
            "Qwen3-Next (Gated DeltaNet + full, MoE)",
            "qwen3_next",
            {**_HYBRID, **_MOE},
            cpu_verdict="error",
            positions_verdict="leak",
            gpu_route="flash-linear-attention + causal-conv1d read cu_seq_lens",
        ),
        Family(
            "bamba",
            "Bamba (Mamba-2 + full)",
            "bamba",
            {"attn_layer_indices": [1]},
            cpu_verdict="error",
            positions_verdict="leak",
            gpu_route="mamba-ssm + causal-conv1d read seq_idx",
        ),
        Family(
            "gpt_oss",
            "GPT-OSS (attention sinks, sliding + full, MoE)",
            "gpt_oss",
            cpu_verdict="leak",
            positions_verdict="leak",
            gpu_route="flash reads cu_seq_lens (its masks ignore position_ids)",
        ),
        Family(
            "mamba2",
            "Mamba-2",
            "mamba2",
            {"num_heads": 8, "state_size": 16, "n_groups": 1, "expand": 2, "chunk_size": 8},
            cpu_verdict="leak",
            positions_verdict="leak",
            gpu_route="mamba-ssm + causal-conv1d read seq_idx",
            # 5.25's torch fallback of causal_conv1d refuses seq_idx (as Bamba's mixers did) instead of ignoring it
            cpu_verdict_since=("5.25", "error"),
        ),
        # Checked for issue 37: the verdicts below are what the probe measured (transformers 5.25, CPU).
        Family("smollm3", "SmolLM3", "smollm3", gpu_route=_ANY),
        Family("olmo2", "Olmo2", "olmo2", gpu_route=_ANY),
        Family("olmo3", "Olmo3 (sliding + full)", "olmo3", gpu_route=_ANY),
        Family("cohere2", "Cohere2 (sliding + full)", "cohere2", gpu_route=_ANY),
        Family("gemma2", "Gemma-2 (sliding + full; no sdpa)", "gemma2", gpu_route=_ANY),
        Family("qwen3_moe", "Qwen3-MoE", "qwen3_moe", gpu_route=_ANY),
        Family("mixtral", "Mixtral (MoE)", "mixtral", gpu_route=_ANY),
        Family("starcoder2", "StarCoder2", "starcoder2", gpu_route=_ANY),
        Family("gpt_neox", "GPT-NeoX", "gpt_neox", gpu_route=_ANY),
        Family("phi", "Phi", "phi", gpu_route=_ANY),
        Family("gpt2", "GPT-2 (learned positions)", "gpt2", gpu_route=_ANY),
        Family("llama4_text", "Llama-4 text (chunked + full, MoE)", "llama4_text", gpu_route=_ANY),
        Family("exaone4", "EXAONE-4 (sliding + full)", "exaone4", gpu_route=_ANY),
        Family("gemma3n", "Gemma-3n text (AltUp, shared KV)", "gemma3n_text", gpu_route=_ANY),
        Family("deepseek_v3", "DeepSeek-V3 (MLA, MoE)", "deepseek_v3", gpu_route=_ANY),
        Family(
            "jamba",
            "Jamba (Mamba-1 + full, MoE)",
            "jamba",
            cpu_verdict="leak",
            positions_verdict="leak",
            gpu_route=_NONE,
        ),
        Family(
            "lfm2",
            "LFM2 (short conv + full)",
            "lfm2",
            {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
            cpu_verdict="error",
            positions_verdict="leak",
            gpu_route="causal-conv1d reads seq_idx; flash reads cu_seq_lens",
        ),
        Family(
            "nemotron_h",
            "Nemotron-H (Mamba-2 + full, MoE)",
            "nemotron_h",
            cpu_verdict="error",
            positions_verdict="leak",
            gpu_route="mamba-ssm + causal-conv1d read seq_idx",
        ),
        Family(
            "minimax",
            "MiniMax (lightning + full, MoE)",
            "minimax",
            cpu_verdict="leak",
            positions_verdict="leak",
            gpu_route=_NONE,
        ),
        Family(
            "recurrent_gemma",
            "RecurrentGemma (RG-LRU + local)",
            "recurrent_gemma",
            cpu_verdict="leak",
            positions_verdict="leak",
            gpu_route=_NONE,
        ),
        Family("mamba", "Mamba (Mamba-1)", "mamba", cpu_verdict="leak", positions_verdict="leak", gpu_route=_NONE),
        Family("rwkv", "RWKV", "rwkv", cpu_verdict="leak", positions_verdict="leak", gpu_route=_NONE),
        Family(
            "bloom",
            "Bloom (ALiBi; eager only)",
            "bloom",
            cpu_verdict="leak",
            positions_verdict="leak",
            gpu_route=_ALIBI,
        ),
        Family("mpt", "MPT (ALiBi; eager only)", "mpt", cpu_verdict="leak", positions_verdict="leak", gpu_route=_ALIBI),
    )
}

# Sizes a tiny model takes, for whichever of these keys its config has.
TINY_SIZES: dict[str, int] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "num_attention_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "state_size": 16,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "moe_shared_expert_intermediate_size": 32,
    "vocab_size_per_layer_input": TINY_VOCAB,  # Gemma-3n's per-layer embeddings
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    "lru_width": 64,  # RecurrentGemma's recurrent block
    "sliding_window": 4,
    "attention_chunk_size": 4,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Two vision blocks (Qwen2.5-VL: one windowed, one full; Qwen3-VL: one feeding its deepstack), 8-dim heads, the
# output as wide as the tiny text model; Qwen2-VL names its width embed_dim and its output hidden_size.
_VISION_BLOCKS: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
}
TINY_VISIONS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "qwen2_vl": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
        "qwen2_5_vl": {**_VISION_BLOCKS, "fullatt_block_indexes": [1], "window_size": 56},
        "qwen3_vl": {**_VISION_BLOCKS, "deepstack_visual_indexes": [0], "num_position_embeddings": 64},
    }
)
TINY_VISION = TINY_VISIONS["qwen2_vl"]  # another model type's vision tower: its own keys where they match
# The image and vision marker tokens inside the tiny vocabulary (the released ids are past it).
TINY_IMAGE_TOKENS = MappingProxyType(
    {"image_token_id": 124, "video_token_id": 125, "vision_start_token_id": 126, "vision_end_token_id": 127}
)


def _fewer_heads(kv_heads: Any, query_heads: Any) -> int:
    """4 query heads and the layout's shape: as many key/value heads (MHA), one (MQA) or two (GQA)."""
    if not isinstance(kv_heads, int) or kv_heads <= 0 or kv_heads == query_heads:
        return 4
    return 1 if kv_heads == 1 else 2


# Config keys that list layer indices (remapped to the layers kept), keys that count layers from the
# first or from the last, per-layer lists that repeat with a period of their own (RecurrentGemma),
# and layers chosen by index % period == offset (Jamba: period -> offset key). mlp_only_layers is
# emptied instead (every layer MoE).
LAYER_INDEX_KEYS = ("full_attn_idxs", "attn_layer_indices", "moe_layers")
LEADING_LAYERS_KEYS = ("first_k_dense_replace",)  # DeepSeek: the first k layers are dense
TRAILING_LAYERS_KEYS = ("num_kv_shared_layers",)  # Gemma-3n: the last n layers reuse earlier caches
CYCLIC_LAYER_KEYS = ("block_types",)
PERIODIC_LAYER_KEYS = {"attn_layer_period": "attn_layer_offset", "expert_layer_period": "expert_layer_offset"}
NOT_PER_LAYER = ("bos_token_id", "eos_token_id", "time_step_limit", "mlp_multipliers", "ssm_multipliers")
# Shrinking reads every layer's kind once; real models have a few hundred layers at most, and a count far
# past that is a typo the probe would spend minutes on before saying anything.
MAX_LAYERS = 100_000


def _layer_facts(settings: Mapping[str, Any], n: int) -> dict[str, list[Any]]:
    """Every per-layer fact of the config as a list of n values (one per layer)."""
    facts: dict[str, list[Any]] = {}
    for key, value in settings.items():
        if key in LAYER_INDEX_KEYS and isinstance(value, list):
            facts[key] = [i in value for i in range(n)]
        elif key in CYCLIC_LAYER_KEYS and isinstance(value, list) and value:
            facts[key] = [value[i % len(value)] for i in range(n)]
        elif isinstance(value, list) and len(value) == n and key not in NOT_PER_LAYER:
            facts[key] = value
    for key in LEADING_LAYERS_KEYS:
        if isinstance(settings.get(key), int):
            facts[key] = [i < settings[key] for i in range(n)]
    for key in TRAILING_LAYERS_KEYS:
        if isinstance(settings.get(key), int):
            facts[key] = [i >= n - settings[key] for i in range(n)]
    for period, offset in PERIODIC_LAYER_KEYS.items():
        if isinstance(settings.get(period), int) and settings[period] > 0 and isinstance(settings.get(offset), int):
            facts[period] = [i % settings[period] == settings[offset] for i in range(n)]
    return facts


def _keep_layers(out: dict[str, Any]) -> None:
    """Keep the first layer of each distinct kind, with every per-layer fact of the config cut to match.

    A kind is everything the config says about one layer (its type, its MoE, its sparsity, whether it
    shares a cache): Gemma-3n's 35 layers keep 6, and its 35-long lists become 6 long.
    """
    n = out.get("num_hidden_layers") or len(out.get("layers_block_type") or ())
    if not isinstance(n, int) or n <= 0:
        out["num_hidden_layers"] = 2
        return
    facts = _layer_facts(out, n)
    first: dict[tuple[str, ...], int] = {}
    for i in range(n):
        first.setdefault(tuple(repr(values[i]) for values in facts.values()), i)
    kept = sorted(first.values())
    kept = kept * 2 if len(kept) == 1 else kept  # two layers: a leak in the first shows in the second
    for key, values in facts.items():
        if key in LAYER_INDEX_KEYS:
            out[key] = [j for j, i in enumerate(kept) if values[i]]
        elif key in LEADING_LAYERS_KEYS or key in TRAILING_LAYERS_KEYS:
            out[key] = sum(values[i] for i in kept)
        elif key in PERIODIC_LAYER_KEYS:
            out[key], out[PERIODIC_LAYER_KEYS[key]] = _period(key, [j for j, i in enumerate(kept) if values[i]], kept)
        else:
            out[key] = [values[i] for i in kept]
    if out.get("num_hidden_layers") is not None or "layers_block_type" not in out:
        out["num_hidden_layers"] = len(kept)


def _period(key: str, members: list[int], kept: list[int]) -> tuple[int, int]:
    """(period, offset) that pick `members` out of the kept layers (Jamba keeps one attention and one MoE)."""
    if len(members) == 1:
        return len(kept), members[0]
    if len(members) == len(kept):
        return 1, 0
    if not members:
        return len(kept) + 1, len(kept)  # no layer of this kind, as in the full config
    raise ProbeError(f"{key}: layers {members} of the {len(kept)} kept are no one period apart")


def shrink(settings: dict[str, Any]) -> dict[str, Any]:
    """A config dict (text part) at the smallest sizes, with every layer type it uses kept once."""
    from transformers import CONFIG_MAPPING

    out = dict(settings)
    if out.get("model_type") in CONFIG_MAPPING:  # GPT-2's n_embd, MPT's d_model: the sizes under their own names
        for name, alias in CONFIG_MAPPING[out["model_type"]].attribute_map.items():
            if alias in out and name not in out:
                out[name] = out.pop(alias)
    for key, value in TINY_SIZES.items():
        if key in out and out[key] is not None:
            out[key] = value
    if "num_key_value_heads" in out:
        out["num_key_value_heads"] = _fewer_heads(settings["num_key_value_heads"], settings.get("num_attention_heads"))
    if "linear_num_key_heads" in out:
        out["linear_num_key_heads"] = _fewer_heads(settings["linear_num_key_heads"], settings["linear_num_value_heads"])
        out["linear_num_value_heads"] = 4
    _keep_layers(out)
    if "mlp_only_layers" in out:
        out["mlp_only_layers"] = []
    if "expand" in out and "num_heads" in out:  # Mamba-2: heads * head_dim must equal expand * hidden
        out["num_heads"] = out["expand"] * out["hidden_size"] // out.get("head_dim", 16)
        out["chunk_size"] = 8  # chunks that straddle the documents
    if "mamba_n_heads" in out:  # the Mamba-2 mixers of hybrids (Bamba, Granite-4, Falcon-H1), same rule
        out["mamba_d_head"] = 16
        out["mamba_n_heads"] = int(out.get("mamba_expand") or 2) * out["hidden_size"] // 16
        out["mamba_n_groups"], out["mamba_chunk_size"] = 1, 8
        if out.get("mamba_d_ssm") is not None:
            out["mamba_d_ssm"] = out["mamba_n_heads"] * 16
    if "mamba_num_heads" in out:  # Nemotron-H's Mamba-2 mixers, same rule under other names
        out["mamba_head_dim"] = 16
        out["mamba_num_heads"] = int(out.get("expand") or 2) * out["hidden_size"] // 16
        out["n_groups"], out["chunk_size"] = 1, 8
    if "kv_lora_rank" in out:  # DeepSeek's latent attention: rotary and plain halves of 8, rope on the first
        out.update(qk_rope_head_dim=8, qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=16, head_dim=8)
        out.update(kv_lora_rank=32, n_group=1, topk_group=1)
        if out.get("q_lora_rank") is not None:
            out["q_lora_rank"] = 32
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and ("mrope_section" in rope or out.get("model_type") in MROPE_MODEL_TYPES):
        out["rope_parameters"] = {**rope, "mrope_section": [2, 3, 3]}  # t/h/w: head_dim / 2 = 8 in all
    out["use_cache"] = False
    return out


def family_config(family: Family) -> Any:
    from transformers import AutoConfig

    base = AutoConfig.for_model(family.model_type).to_dict()
    text = base.get("text_config", base)
    tiny = shrink({**text, **family.settings})
    if "text_config" in base:
        vision = dict(TINY_VISIONS.get(family.model_type, TINY_VISION))
        return AutoConfig.for_model(family.model_type, text_config=tiny, vision_config=vision, **TINY_IMAGE_TOKENS)
    return AutoConfig.for_model(family.model_type, **{k: v for k, v in tiny.items() if k != "model_type"})


def family_table() -> str:
    """docs/isolation.md's family x backend table, from FAMILIES (tests/loader/test_probe.py runs every row on CPU).

    Layer types and inputs are those of the tiny model built on eager (sdpa gets the same inputs).
    """
    lines = [
        "| family | `--probe` | layer types | `model_inputs` passes (eager, sdpa) | eager, sdpa (CPU) "
        "| position_ids only (CPU) | one document per row | GPU: what keeps documents apart |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in FAMILIES.values():
        model = build_tiny(family_config(f), "eager")
        mb = packed_row(synthetic_docs((2, 2), TINY_VOCAB))
        passed = {k: v for k, v in model_inputs(mb, model).items() if k != "input_ids"}
        shape = " [4, 1, T]" if config_uses_mrope(model.config) else ""
        shown = ", ".join(
            f"`{k}={v}`" if v is None or isinstance(v, bool) else f"`{k}`{shape if k == 'position_ids' else ''}"
            for k, v in passed.items()
        )
        kinds = ", ".join(dict.fromkeys(model_layer_kinds(model)))
        lines.append(
            f"| {f.label} | `{f.key}` | {kinds} | {shown} | {f.cpu_verdicts} | {f.positions_verdict} | pass "
            f"| {f.gpu_route} |"
        )
    return "\n".join(lines)


def resolve_config(model: str, *, tiny: bool = True) -> Any:
    """MODEL as a family key, a config.json, a model folder or a hub id in the local cache -> a config.

    tiny: shrunk to the smallest sizes (the probe's random-weight model); else as written.
    """
    if model in FAMILIES:
        return family_config(FAMILIES[model])
    config = read_config(model)
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise ProbeError(
            f"{_config_file(model)}: num_hidden_layers {layers}: a model without layers has no documents "
            "to keep apart; fix num_hidden_layers (1 or more)"
        )
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise ProbeError(
            f"{_config_file(model)}: num_hidden_layers {layers:,}: more layers than any model has; "
            f"fix num_hidden_layers (at most {MAX_LAYERS:,})"
        )
    if not tiny:
        return config
    try:
        return _shrunk(config)
    except Exception as err:  # transformers refuses the shrunk settings: say which model and why
        raise ProbeError(
            f"{_config_file(model)}: no tiny copy of model_type {config.model_type!r} could be made ({_short(err)}); "
            "probe its real weights (--weights)"
        ) from None


def _config_file(model: str) -> str:
    path = Path(model)
    return str(path / "config.json") if path.is_dir() else model


def _raw_config(model: str) -> dict[str, Any]:
    """config.json as written (a local file or folder; {} for a hub id), or one line on why it is not a config."""
    path = Path(_config_file(model))
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProbeError(f"{path}: not a JSON config ({err}); give a model's config.json") from None
    if not isinstance(raw, dict):
        raise ProbeError(f"{path}: a JSON {type(raw).__name__}, not a config object; give a model's config.json")
    return raw


def read_config(model: str) -> Any:
    """A config.json, model folder or cached hub id -> its transformers config; never runs custom code.

    transformers asks on the terminal before running a checkpoint's own code (auto_map); the probe
    runs none, so that question never reaches the output: a model_type transformers does not know is
    one line here.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    path = Path(model)
    where = _config_file(model)
    if path.is_dir() and not Path(where).is_file():
        raise ProbeError(f"{model}: a folder without config.json; give a model folder or its config.json")
    if not path.exists() and path.suffix == ".json":
        raise ProbeError(f"{model}: no such file; give a model's config.json, a model folder or a family name")
    raw = _raw_config(model)
    try:
        if Path(model).exists():
            return AutoConfig.from_pretrained(model, trust_remote_code=False)
        return AutoConfig.from_pretrained(model, local_files_only=True, trust_remote_code=False)
    except Exception as err:
        lines = str(err).strip().splitlines()
        if lines and lines[0].startswith("Validation error for field"):  # huggingface_hub's strict dataclasses
            field = lines[0].removeprefix("Validation error for ").rstrip(":")
            raise ProbeError(f"{where}: {field}: {lines[-1].strip()}; fix that value") from None
        if lines and lines[0].startswith("Class validation error"):  # fields that disagree with each other
            raise ProbeError(f"{where}: {lines[-1].strip()}; fix config.json") from None
        model_type = raw.get("model_type")
        if isinstance(err, ArithmeticError) and model_type in CONFIG_MAPPING:  # heads 0: head_dim = hidden // 0
            raise ProbeError(
                f"{where}: transformers' {model_type} config refuses its values ({_short(err)}); fix config.json"
            ) from None
        if not isinstance(err, (OSError, ValueError, KeyError, TypeError)):
            raise
        if raw and model_type is not None:
            custom = " (its auto_map names custom code, which packtool does not run)" if raw.get("auto_map") else ""
            raise ProbeError(
                f"{where}: model_type {model_type!r} could not be read by transformers {_transformers_version()}"
                f"{custom} ({_short(err)}); probe a built-in family ({_families()}) or upgrade transformers"
            ) from None
        if raw:
            message = f"{where}: not a transformers config ({_short(err)}); give a model's config.json"
            raise ProbeError(message) from None
        raise ProbeError(
            f"--probe {model}: not a family ({_families()}), a config.json, a model folder or a hub id "
            f"in the local cache ({_short(err)[:200]}); download it first "
            f"(hf download {model if hub.is_repo_id(model) else 'ORG/NAME'} config.json)"
        ) from None


def _families() -> str:
    """The family names for an error line: the first few, and where the rest are listed."""
    return f"{', '.join(list(FAMILIES)[:5])}, ... {len(FAMILIES)} in docs/isolation.md"


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def probed_notes(model: str, config: Any, *, tiny: bool) -> tuple[str, ...]:
    """One line for each way the model probed differs from what MODEL names."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if model in FAMILIES:
        return ()
    raw = _raw_config(model)
    notes = []
    auto_map = raw.get("auto_map") or getattr(config, "auto_map", None)
    if auto_map:
        names = ", ".join(sorted({str(v if isinstance(v, str) else v[0]) for v in dict(auto_map).values()}))
        notes.append(
            f"custom code not run: the config's auto_map names {names}; probed transformers' built-in "
            f"model_type {config.model_type!r} instead, which may differ from the checkpoint's own code"
        )
    quantization = getattr(config, "quantization_config", None)
    if tiny and quantization:
        method = dict(quantization).get("quant_method", "?") if isinstance(quantization, Mapping) else "?"
        notes.append(f"quantization_config ({method}) not applied: the tiny copy runs unquantized weights")
    if config.get_text_config().model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        notes.append(
            f"model_type {config.model_type!r} is an encoder (masked LM); probed its causal-LM head, "
            "the way packtool's causal-LM training runs it"
        )
    return tuple(notes)


def _shrunk(config: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    text = config.get_text_config()
    if type(text) in AutoModelForCausalLM._model_mapping and text is not config:
        # A multimodal checkpoint whose text model stands alone (Qwen3.5): probe the text model.
        settings = shrink(text.to_dict())
        return AutoConfig.for_model(settings.pop("model_type"), **settings)
    settings = config.to_dict()
    if "text_config" in settings:
        settings["text_config"] = shrink(settings["text_config"])
        tiny_vision = TINY_VISIONS.get(settings.get("model_type", ""), TINY_VISION)
        settings["vision_config"] = {**settings.get("vision_config", {}), **tiny_vision}
        settings.update(TINY_IMAGE_TOKENS)
    else:
        settings = shrink(settings)
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def _model_class(config: Any) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText  # Qwen2-VL and kin: no causal-LM class, text-only input works


def build_tiny(config: Any, backend: str, seed: int = 0, dtype: torch.dtype | None = None) -> Any:
    """A random-weight model of `config` on `backend`, eval mode, on CUDA when there is one.

    float64 on eager and sdpa, so that a leak far below float32's rounding still shows (MoE experts
    run their eager loop: the grouped kernels refuse float64); float32 on flex, whose kernels stop
    at float32; bfloat16 for the flash-attention backends (half precision only).
    """
    torch.manual_seed(seed)
    if dtype is None:
        dtype = torch.bfloat16 if backend.startswith("flash") else torch.float32
        dtype = torch.float64 if backend in CPU_BACKENDS else dtype
    from transformers import PreTrainedModel

    # transformers from 5.0 picks a kernel for MoE experts (grouped_mm refuses float64)
    settable = hasattr(PreTrainedModel, "get_correct_experts_implementation")
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 and settable else {}
    model = _model_class(config).from_config(config, attn_implementation=backend, **experts)
    return model.to("cuda" if torch.cuda.is_available() else "cpu", dtype).eval()


NOT_FINITE = "its logits are not finite with each document alone (NaN or inf: check the config's numbers)"


def _finite_in_rows(model: Any, mb: MicroBatch) -> bool:
    """Whether the model gives finite logits for one document per padded row (float64 eager sliding
    masks overflow to NaN there: then the probe runs float32)."""
    try:
        with torch.no_grad():
            inputs = _forward_inputs(one_document_per_row, mb, model)
            return bool(torch.isfinite(model(**inputs).logits).all())
    except Exception:  # the checks report what fails, with its reason
        return True


def available_backends() -> tuple[str, ...]:
    return GPU_BACKENDS if torch.cuda.is_available() else CPU_BACKENDS


# ---- the checks ----


@dataclass(frozen=True, slots=True)
class CheckResult:
    check: str
    worst: float  # the largest difference seen (NaN when the check could not run)
    ok: bool


@dataclass(frozen=True, slots=True)
class ProbeRow:
    """One backend x feed combination."""

    backend: str
    feed: str
    status: str  # pass | leak | error | skip
    checks: tuple[CheckResult, ...] = ()
    detail: str = ""  # the culprit and the fix (leak, error), or why it was skipped

    @property
    def failed(self) -> bool:
        return self.status in ("leak", "error")


@dataclass(frozen=True, slots=True)
class ProbeReport:
    model: str
    architecture: str
    layer_kinds: tuple[str, ...]
    weights: str  # "tiny random" or "real"
    dtype: str
    rows: tuple[ProbeRow, ...]
    notes: tuple[str, ...] = ()  # what was probed where it is not what MODEL names (custom code, quantization)

    @property
    def verdict(self) -> str:
        """pass | leak (a combination leaks or refuses the boundaries) | could not run (no combination ran)."""
        if any(r.failed for r in self.rows):
            return "leak"
        return "pass" if any(r.status == "pass" for r in self.rows) else "could not run"

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "verdict": self.verdict, **asdict(self)}


def synthetic_docs(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) per document: random ids, every token a target but the first."""
    if vocab < FIRST_ID + 2:
        raise ProbeError(
            f"vocab_size {vocab}: the probe needs at least {FIRST_ID + 2} token ids (pad/bos/eos and two to swap); "
            "fix vocab_size in config.json"
        )
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths:
        ids = rng.integers(FIRST_ID, vocab, size=n)
        labels = ids.copy()
        labels[0] = IGNORE_INDEX
        docs.append((ids, labels))
    return docs


def packed_row(docs: Sequence[tuple[np.ndarray, np.ndarray]]) -> MicroBatch:
    lengths = [len(ids) for ids, _ in docs]
    return collate(
        [
            {
                "input_ids": np.concatenate([d[0] for d in docs]),
                "labels": np.concatenate([d[1] for d in docs]),
                "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]),
            }
        ]
    )


def docs_from_build(
    out: str | Path, vocab: int, max_tokens: int = 256, max_packs: int = 64
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The documents of the build's first pack with two or more (their lengths and labels, ids folded into vocab).

    Documents, not attention segments: a stream build's windows are read with their document starts.
    """
    from packtool.loader.dataset import PackedDataset

    packs = PackedDataset(out, shuffle=False, isolate_documents=True)
    for pack in itertools.islice(packs, max_packs):
        cu = np.asarray(pack.cu_seqlens).tolist()
        if len(cu) < 3:
            continue
        docs: list[tuple[np.ndarray, np.ndarray]] = []
        used = 0
        for lo, hi in itertools.pairwise(cu):
            if docs and used + hi - lo > max_tokens:
                break
            ids = np.asarray(pack.input_ids[lo:hi], dtype=np.int64)
            labels = np.asarray(pack.labels[lo:hi], dtype=np.int64)
            docs.append((_fold(ids, vocab), np.where(labels == IGNORE_INDEX, IGNORE_INDEX, _fold(labels, vocab))))
            used += hi - lo
        if len(docs) >= 2:
            return docs
    raise ProbeError(
        f"{out}: none of the first {max_packs} packs holds two documents; probe with synthetic rows (leave out --data)"
    )


def _fold(ids: np.ndarray, vocab: int) -> np.ndarray:
    """Real token ids into a tiny model's vocabulary (boundaries and lengths are what the probe needs)."""
    return FIRST_ID + ids % (vocab - FIRST_ID)


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _as_packed(values: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
    """[1, T, ...] or one-document-per-row [S, W, ...] -> [T, ...] in the packed row's order."""
    if values.shape[0] == 1:
        return values[0]
    mask = inputs["attention_mask"].bool()
    return values[mask]


class _LayerOutputs:
    """Forward hooks that keep every decoder layer's output (in the packed row's order)."""

    def __init__(self, model: Any) -> None:
        self.outputs: list[torch.Tensor] = []
        self.inputs: Mapping[str, Any] = {}
        self.dtype = torch.float64  # of the last forward's output
        self.handles = [layer.register_forward_hook(self._keep) for layer in decoder_layers(model)]

    def _keep(self, module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.dim() == 4:  # Gemma-3n's AltUp streams, [K, B, T, H]
            hidden = hidden.movedim(0, 2)
        self.outputs.append(_as_packed(hidden.detach().double(), self.inputs))

    def run(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self.outputs, self.inputs = [], inputs
        logits = model(**inputs).logits
        self.dtype = logits.dtype
        return _as_packed(logits.double(), inputs), self.outputs

    def run_forward(
        self, model: Any, mb: MicroBatch, forward: Callable[[Any, MicroBatch], torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A training loop's own forward of the packed row (logits or hidden states, [1, T, ...])."""
        self.outputs, self.inputs = [], {}
        values = forward(model, mb)
        if not isinstance(values, torch.Tensor):  # a model output or per-segment sums: nothing per token
            raise IsolationError(
                f"check_isolation's forward returned {type(values).__name__}; it must return the packed row's "
                "[1, T, ...] logits or hidden states (e.g. model.model(**model_inputs(mb, model)).last_hidden_state)"
            )
        if values.dim() < 2 or tuple(values.shape[:2]) != tuple(mb.input_ids.shape):
            raise IsolationError(
                f"check_isolation's forward returned shape {tuple(values.shape)} for a packed row of "
                f"{tuple(mb.input_ids.shape)}; it must return that row's [1, T, ...] logits or hidden states"
            )
        self.dtype = values.dtype
        return values[0].double(), self.outputs

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _forward_inputs(feed: Callable[[MicroBatch, Any], dict[str, Any]], mb: MicroBatch, model: Any) -> dict[str, Any]:
    inputs = dict(feed(mb.to(_device(model)), model))
    inputs.pop("labels", None)
    return inputs


def _perturbed(mb: MicroBatch, vocab: int) -> MicroBatch:
    """The row with document 0's last token changed (the token next to the boundary)."""
    last = int(mb.cu_seqlens[1]) - 1
    ids = mb.input_ids.clone()
    ids[0, last] = FIRST_ID + (int(ids[0, last]) - FIRST_ID + 1) % (vocab - FIRST_ID)
    return MicroBatch(
        input_ids=ids,
        labels=mb.labels,
        position_ids=mb.position_ids,
        cu_seqlens=mb.cu_seqlens,
        max_seqlen=mb.max_seqlen,
        n_targets=mb.n_targets,
        n_packs=mb.n_packs,
    )


@dataclass(frozen=True, slots=True)
class Perturbation:
    outside: float  # largest logit change outside document 0
    inside: float  # largest logit change inside document 0 (the perturbation did something)
    culprit: str  # "layer 0 (linear_attention)" for the first decoder layer whose output leaked, else ""
    leaks: bool
    limit: float  # the change allowed at this precision and logit scale


# bf16 keeps 8 significant bits (a relative step of 2^-8 = 3.9e-3): a kernel that groups other rows
# differently (MoE experts, split-K GEMMs) may move an isolated value by a step or two of its size.
HALF_RELATIVE = 2e-2


def _moved(before: torch.Tensor, after: torch.Tensor, dtype: torch.dtype) -> tuple[float, bool]:
    """The largest change and whether it is beyond rounding for `dtype` at the values' own scale."""
    if not before.numel():
        return 0.0, False
    change = float((before - after).abs().max())
    return change, change > _limit(dtype, float(before.abs().max()))


def perturbation(
    model: Any,
    mb: MicroBatch,
    feed: Callable[[MicroBatch, Any], dict[str, Any]],
    forward: Callable[[Any, MicroBatch], torch.Tensor] | None = None,
) -> Perturbation:
    """Two forwards: the row, and the row with one token of document 0 changed (through `forward` when given)."""
    vocab = int(model.config.get_text_config().vocab_size)
    end = int(mb.cu_seqlens[1])
    kinds = model_layer_kinds(model)
    hooks = _LayerOutputs(model)
    try:
        with torch.no_grad():
            if forward is None:
                before, layers_before = hooks.run(model, _forward_inputs(feed, mb, model))
                after, layers_after = hooks.run(model, _forward_inputs(feed, _perturbed(mb, vocab), model))
            else:
                device = _device(model)
                before, layers_before = hooks.run_forward(model, mb.to(device), forward)
                after, layers_after = hooks.run_forward(model, _perturbed(mb, vocab).to(device), forward)
    finally:
        hooks.close()
    dtype = _coarsest(next(model.parameters()).dtype, hooks.dtype)
    culprit = ""
    for i, (a, b) in enumerate(zip(layers_before, layers_after, strict=True)):
        if _moved(a[end:], b[end:], dtype)[1]:
            culprit = f"layer {i} ({kinds[i] if i < len(kinds) else 'unknown'})"
            break
    outside, leaks = _moved(before[end:], after[end:], dtype)
    inside = float((before[:end] - after[:end]).abs().max())
    limit = _limit(dtype, float(before[end:].abs().max()) if end < len(before) else 0.0)
    return Perturbation(outside=outside, inside=inside, culprit=culprit, leaks=leaks, limit=limit)


def _alone_logits(model: Any, mb: MicroBatch) -> list[torch.Tensor]:
    bounds = mb.cu_seqlens.tolist()
    device = _device(model)
    return [
        model(input_ids=mb.input_ids[:, lo:hi].to(device), use_cache=False).logits[0]
        for lo, hi in itertools.pairwise(bounds)
    ]


def _gradient_leak(model: Any, mb: MicroBatch, feed: Callable[[MicroBatch, Any], dict[str, Any]]) -> float:
    """Largest |d(last document's logits)/d(embedding)| outside that document, relative to inside."""
    inputs = _forward_inputs(feed, mb, model)
    embeds = model.get_input_embeddings()(inputs.pop("input_ids")).detach().requires_grad_()
    logits = _as_packed(model(inputs_embeds=embeds, **inputs).logits.double(), inputs)
    start = int(mb.cu_seqlens[-2])
    logits[start:].square().mean().backward()
    grads = _as_packed(embeds.grad, inputs).abs().amax(dim=-1)  # type: ignore[union-attr]
    inside = float(grads[start:].max())
    return float(grads[:start].max()) / inside if inside > 0 else float("inf")


def _loss_difference(model: Any, mb: MicroBatch, feed: Callable[[MicroBatch, Any], dict[str, Any]], alone) -> float:
    device = _device(model)
    inputs = dict(feed(mb.to(device), model))
    labels = inputs.pop("labels", mb.labels.to(device))
    n = torch.tensor(mb.n_targets, device=device)
    loss = float(model(**inputs, labels=labels, num_items_in_batch=n).loss)
    bounds = mb.cu_seqlens.tolist()
    per_doc = [
        float(token_loss_sum(logits[None].double(), mb.labels[:, lo:hi].to(device))[0])
        for logits, lo, hi in zip(alone, bounds[:-1], bounds[1:], strict=True)
    ]
    alone_loss = sum(per_doc) / mb.n_targets
    return abs(loss - alone_loss) / max(abs(alone_loss), 1.0)  # relative, as the other checks


def run_checks(model: Any, mb: MicroBatch, feed_name: str) -> ProbeRow:
    """All four checks on one model (its backend already set) with one feed."""
    backend = str(model.config._attn_implementation)
    feed = FEEDS[feed_name]
    kinds = model_layer_kinds(model)
    try:
        with torch.no_grad():
            alone = _alone_logits(model, mb)
    except Exception as err:  # the backend cannot run this model at all: not a packing question
        return ProbeRow(backend, feed_name, "skip", detail=f"unpacked forward failed: {_short(err)}")
    dtype = _coarsest(next(model.parameters()).dtype, alone[0].dtype)
    try:
        with torch.no_grad():
            inputs = _forward_inputs(feed, mb, model)
            packed = _as_packed(model(**inputs).logits.double(), inputs)
        moved = perturbation(model, mb, feed)
        gradient = _gradient_leak(model, mb, feed)
        with torch.no_grad():
            loss = _loss_difference(model, mb, feed, alone)
    except Exception as err:  # the model refuses the packed inputs: training on them would fail or leak
        return ProbeRow(backend, feed_name, "error", detail=error_message(kinds, feed_name, err, model))
    # Changes relative to the largest logit: a model initialised small has small logits and small leaks.
    scale = max(max(float(a.abs().max()) for a in alone), torch.finfo(torch.float64).tiny)  # all-zero logits
    same = max(float((packed[lo:hi] - a.double()).abs().max()) for a, lo, hi in _spans(alone, mb)) / scale
    tol, loose = tolerance(dtype), tolerance(dtype, recomputed=True)
    checks = (
        CheckResult("packed_vs_alone", same, same <= loose),
        CheckResult("perturbation", moved.outside / scale, not moved.leaks and moved.inside > moved.limit),
        CheckResult("gradients", gradient, gradient <= tol),
        CheckResult("loss", loss, loss <= loose),
    )
    if all(c.ok for c in checks):
        return ProbeRow(backend, feed_name, "pass", checks)
    return ProbeRow(backend, feed_name, "leak", checks, leak_message(kinds, feed_name, moved.culprit, model))


def _spans(alone: list[torch.Tensor], mb: MicroBatch):
    bounds = mb.cu_seqlens.tolist()
    return zip(alone, bounds[:-1], bounds[1:], strict=True)


def _short(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


# What a recurrent layer reads to stop at a document end, with its CUDA kernels; the kinds missing
# here (Mamba-1, MiniMax's lightning attention, RecurrentGemma's RG-LRU, RWKV) read none at all.
FIX_RECURRENT = {
    "linear_attention": "install flash-linear-attention and causal-conv1d (CUDA; they read cu_seq_lens_q)",
    "mamba": "install mamba-ssm and causal-conv1d (CUDA; they read seq_idx)",
    "conv": "install causal-conv1d (CUDA; it reads seq_idx)",
}
# The ways to train one document per row: a Trainer's collator, or a loop's loader.
ONE_PER_ROW = (
    "PackedCollator(model, one_document_per_row=True) for a Trainer, PackedDataset(isolate_documents=True) in a loop"
)
FIX_FALLBACK = f"train one document per row ({ONE_PER_ROW})"
FIX_FEED = "feed packtool.loader.hf.model_inputs(mb, model) (the boundaries this model reads)"
# Backends that read packtool's boundaries (a mask from restarting positions; cu_seq_lens), with
# the class flag that says a model runs on them.
BOUNDARY_BACKENDS = (("sdpa", "_supports_sdpa"), ("flash_attention_2", "_supports_flash_attn"))


def other_backends(model: Any) -> tuple[str, ...]:
    """The backends that read boundaries which `model` supports and is not already on."""
    current = str(getattr(model.config, "_attn_implementation", None) or "eager")
    return tuple(name for name, flag in BOUNDARY_BACKENDS if getattr(model, flag, False) and name != current)


def fix_for(kind: str, feed: str, model: Any, fallback: str = FIX_FALLBACK) -> str:
    """The advice for a leak or a refusal in a layer of `kind`: only what that layer and model can use,
    the kernels only where they run (CUDA), and `fallback` (one document per row) as the caller spells it."""
    if kind in FIX_RECURRENT:
        if not torch.cuda.is_available():
            return f"{fallback}; on a CUDA machine, also: {FIX_RECURRENT[kind]} (not here: this machine has no CUDA)"
        return f"{FIX_RECURRENT[kind]}, or {fallback}"
    if kind in RECURRENT_KINDS:
        return f"{fallback}; {kind} layers read no document boundary"
    if feed != "model_inputs":
        return f"{FIX_FEED}, or {fallback}"
    backends = other_backends(model)
    return f"use another attention backend ({', '.join(backends)}), or {fallback}" if backends else fallback


def leak_message(kinds: Sequence[str], feed: str, culprit: str, model: Any, fallback: str = FIX_FALLBACK) -> str:
    kind = culprit.split("(")[-1].rstrip(")") if culprit else _first_recurrent(kinds)
    where = culprit or f"{kind} layers"
    return f"{where} carries one document into the next; fix: {fix_for(kind, feed, model, fallback)}"


def error_message(kinds: Sequence[str], feed: str, err: BaseException, model: Any, fallback: str = FIX_FALLBACK) -> str:
    kind = _first_recurrent(kinds)
    return f"{kind} layers refuse the packed inputs ({_short(err)}); fix: {fix_for(kind, feed, model, fallback)}"


def _first_recurrent(kinds: Sequence[str]) -> str:
    return next((k for k in kinds if k in RECURRENT_KINDS), kinds[0] if kinds else "attention")


def reads_images(model: Any) -> bool:
    """A Qwen-VL model: a vision tower fed pixel_values and image_grid_thw, mRoPE positions from get_rope_index."""
    inner = getattr(model, "model", None)
    return hasattr(inner, "visual") and hasattr(inner, "get_rope_index") and hasattr(model.config, "image_token_id")


def image_row(model: Any) -> ProbeRow:
    from packtool.loader.vision_probe import image_row as checked  # it builds on this module

    return checked(model)


def check_backend_name(name: str) -> None:
    """Refuse a backend transformers does not know by that name, before any model is built: a misspelt one
    ("Eager") would otherwise be a skipped row beside the ones that ran, and the probe would pass without it.
    A name transformers knows but this machine cannot run (flash_attention_2 without CUDA) stays a skipped row;
    a hub kernel ("org/name") is left to transformers, which fetches it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ("eager", *ALL_ATTENTION_FUNCTIONS.valid_keys())
    plain = name.removeprefix("paged|")
    if plain in known or "/" in plain:
        return
    raise ProbeError(f"--backend {name}: not an attention implementation transformers knows; choose {', '.join(known)}")


def probe(
    model: str,
    *,
    backends: Sequence[str] | None = None,
    feeds: Sequence[str] | None = None,
    data: str | Path | None = None,
    weights: bool = False,
) -> ProbeReport:
    """Every backend x feed on a tiny random model of MODEL (or its real weights with `weights`).

    Without `feeds`: model_inputs (what packtool feeds), and on a backend where that leaks or is
    refused, one document per row too, the way out a user then needs to see."""
    fallback = feeds is None
    feeds = feeds or ("model_inputs",)
    for name in feeds:
        if name not in FEEDS:
            raise ProbeError(f"--feed {name}: unknown; choose {', '.join(FEEDS)}")
    for name in backends or ():
        check_backend_name(name)
    config = resolve_config(model, tiny=not weights)
    vocab = int(config.get_text_config().vocab_size)
    docs = docs_from_build(data, vocab) if data is not None else synthetic_docs(DOC_LENGTHS, vocab)
    mb = packed_row(docs)
    rows: list[ProbeRow] = []
    architecture, dtype, kinds = "", "", layer_kinds(config)
    for backend in backends or available_backends():
        try:
            built = load_real(model, backend) if weights else build_tiny(config, backend)
            if not weights and not _finite_in_rows(built, mb):
                built = build_tiny(config, backend, dtype=torch.float32)
        except (ValueError, ImportError, OSError) as err:
            rows.extend(ProbeRow(backend, f, "skip", detail=f"cannot build: {_short(err)}") for f in feeds)
            continue
        if not _finite_in_rows(built, mb):  # NaN against NaN reads as a leak: there is nothing to compare
            rows.extend(ProbeRow(backend, f, "skip", detail=NOT_FINITE) for f in feeds)
            continue
        architecture, kinds = type(built).__name__, model_layer_kinds(built)
        dtype = str(next(built.parameters()).dtype).removeprefix("torch.")
        tried = [run_checks(built, mb, feed) for feed in feeds]
        if fallback and any(row.failed for row in tried):
            tried.append(run_checks(built, mb, "one_document_per_row"))
        if "model_inputs" in feeds and reads_images(built):  # a vision-language model: packed image documents too
            tried.append(image_row(built))
        rows.extend(tried)
        del built
    weights_kind = "real" if weights else "tiny random"
    notes = probed_notes(model, config, tiny=not weights)
    return ProbeReport(model, architecture, kinds, weights_kind, dtype, tuple(rows), notes)


def load_real(model: str, backend: str) -> Any:
    if model in FAMILIES:
        raise ProbeError(f"--weights needs a model folder or a cached hub id, not the family name {model!r}")
    if Path(model).is_file():  # transformers would read config.json itself as the weights (torch.load)
        raise ProbeError(f"--weights {model}: a file; give the model folder that holds it and the weights")
    config = read_config(model)
    try:
        loaded = _model_class(config).from_pretrained(
            model,
            config=config,
            attn_implementation=backend,
            local_files_only=True,
            dtype="auto",
            trust_remote_code=False,
        )
    except (ValueError, ImportError, OSError):
        raise  # the backend cannot run this model, or no weights are there: the backend's row says so
    except Exception as err:  # a weights file cut short or not what its name says (safetensors, pickle)
        raise ProbeError(
            f"{model}: its weights could not be read ({_short(err)}); check or download them again"
        ) from None
    return loaded.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def format_probe(report: ProbeReport) -> str:
    head = (
        f"probe {report.model}: {report.architecture or '?'} ({report.weights} weights, {report.dtype or '?'}), "
        f"layers: {', '.join(dict.fromkeys(report.layer_kinds))}"
    )
    lines = [head, *(f"note: {note}" for note in report.notes)]
    # the text checks, then any other rows' own (a vision-language model's image checks)
    columns = list(dict.fromkeys([*CHECKS, *(c.check for row in report.rows for c in row.checks)]))
    lines.append(f"{'backend':<18} {'feed':<21} " + " ".join(f"{c:>15}" for c in columns) + "  verdict")
    for row in report.rows:
        cells = {c.check: f"{c.worst:.1e}{'' if c.ok else '!'}" for c in row.checks}
        shown = " ".join(f"{cells.get(c, '-'):>15}" for c in columns)
        verdict = row.status.upper() + (f": {row.detail}" if row.detail else "")
        lines.append(f"{row.backend:<18} {row.feed:<21} {shown}  {verdict}")
    if report.verdict == "could not run":
        why = "; ".join(dict.fromkeys(f"{row.backend}: {row.detail}" for row in report.rows)) or "no backend given"
        lines.append(f"could not run: no backend ran {report.model} ({why}); nothing was compared")
    elif report.ok:
        lines.append("ok: packed documents stay apart")
    else:
        failed = [row for row in report.rows if row.failed]
        what = "let documents leak" if any(row.status == "leak" for row in failed) else "refuse the packed inputs"
        combos = ", ".join(dict.fromkeys(f"{row.backend} x {row.feed}" for row in failed))
        lines.append(f"FAILED: {combos} {what}")
        if any(row.feed == "one_document_per_row" and row.status == "pass" for row in report.rows):
            lines.append(f"one document per row passes: train with {ONE_PER_ROW}")
    return "\n".join(lines)


# ---- the guard the trainers run ----


def check_isolation(
    model: Any,
    mb: MicroBatch | None = None,
    *,
    feed: Callable[[MicroBatch, Any], dict[str, Any]] = model_inputs,
    forward: Callable[[Any, MicroBatch], torch.Tensor] | None = None,
    fallback: str = FIX_FALLBACK,
) -> float | None:
    """Raise IsolationError if changing document 0 of a short packed row moves another document's logits.

    Two forwards of the real model with the inputs `feed` gives it (the trainer passes its own
    collator), in eval mode and without gradients. A training loop that calls the model itself
    passes that call as `forward(model, mb)` instead, returning the row's [1, T, ...] logits or
    hidden states (`model.model(**model_inputs(mb, model)).last_hidden_state`), so the guard runs
    exactly what the loop trains on (docs/loader.md). Returns the largest change seen outside
    document 0, or None when skipped: PACKTOOL_SKIP_ISOLATION_CHECK=1, or parameters sharded
    (ZeRO-3, FSDP) before the trainer wraps the model (logged; probe such a model with
    `packtool audit --probe`). `fallback` is how the caller trains one document per row, named in
    the advice (a trainer spells out its own constructor).
    """
    if forward is not None and feed is not model_inputs:
        raise TypeError("check_isolation takes feed= or forward=, not both: forward(model, mb) feeds the model itself")
    if os.environ.get(SKIP_ENV) == "1":
        return None
    if any(p.numel() == 0 for p in model.parameters()):
        # ZeRO-3 / FSDP hold empty shards until the wrapped model gathers them; a forward here would fail.
        log.warning("check_isolation skipped: %s has sharded parameters; run `packtool audit --probe`", type(model))
        return None
    if mb is None:
        mb = packed_row(synthetic_docs(GUARD_LENGTHS, int(model.config.get_text_config().vocab_size)))
    kinds = model_layer_kinds(model)
    name = f"{type(model).__name__} ({getattr(model.config, '_attn_implementation', None) or 'eager'})"
    fed = "model_inputs" if forward is None else "forward"  # a loop's own forward may feed the model by hand
    training = model.training
    model.eval()
    try:
        moved = perturbation(model, mb, feed, forward)
    except PacktoolError:
        raise
    except Exception as err:  # the model's own refusal is quoted in the message: no second traceback
        message = error_message(kinds, fed, err, model, fallback)
        raise IsolationError(f"{name}: {message}{SKIPPING}") from None
    finally:
        model.train(training)
    if moved.leaks:
        cause = leak_message(kinds, fed, moved.culprit, model, fallback)
        if forward is None and _cache_is_the_cause(model, mb, feed):
            cause = (
                f"the feed leaves the KV cache on (config.use_cache=True, no use_cache=False), and with a cache "
                f"HF builds no block mask; fix: pass use_cache=False, or {FIX_FEED}"
            )
        raise IsolationError(
            f"{name}: packed documents leak (logits of later documents moved {moved.outside:.1e}): {cause}{SKIPPING}"
        )
    return moved.outside


def _cache_is_the_cause(model: Any, mb: MicroBatch, feed: Callable[[MicroBatch, Any], dict[str, Any]]) -> bool:
    """Whether the feed leaves the cache to a config saying use_cache=True, and the same feed with
    use_cache=False keeps the documents apart (two more forwards, only once a leak is found)."""
    if not getattr(model.config, "use_cache", False) or _forward_inputs(feed, mb, model).get("use_cache") is False:
        return False
    training = model.training
    model.eval()
    try:
        return not perturbation(model, mb, lambda batch, net: {**feed(batch, net), "use_cache": False}).leaks
    except Exception:  # the feed fails without the cache too: the cache is not what leaks
        return False
    finally:
        model.train(training)
