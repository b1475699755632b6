"""Document boundaries as each model family reads them: one micro-batch -> a model's forward kwargs.

A packed row only trains like its documents alone when every layer of the model is told where
the documents end, in the argument that layer type reads. For cu_seqlens [0, 3, 5] (A, B)::

    input_ids       [[a0 a1 a2 b0 b1]]
    position_ids    [[0  1  2  0  1 ]]           full/sliding attention on eager, sdpa (mask built
                                                 from restarting positions when attention_mask is None)
    position_ids    [[[0 1 2 0 1]] x 4]          mRoPE (Qwen2-VL): text positions first, then t/h/w;
                                                 2D positions are expanded to t/h/w only and the mask
                                                 falls back to one causal row (measured: 0.53 logit leak);
                                                 a vision build's t/h/w rows are its stored ones
    pixel_values, image_grid_thw                 a vision build's images (packtool.loader.vision): the
                                                 vision tower attends within each image by its grid
    cu_seq_lens_q/k [0, 3, 5], max_length_q/k 3  flash-attention backends; Gated DeltaNet layers with
                                                 the flash-linear-attention kernel
    seq_idx         [[0  0  0  1  1 ]] int32     Mamba-2 / conv layers with the mamba-ssm and
                                                 causal-conv1d kernels
    BlockMask       (flex_block_mask)            flex attention, as attention_mask
    cu_seq_q/k ...  (varlen_kwargs)              torch.nn.attention.varlen.varlen_attn, where present

`model_inputs(mb, model)` gives all of those a model's layer types read (and `use_cache=False`,
`attention_mask=None`: with either, HF models ignore restarting positions). Which families and
backends then keep documents apart is measured, not assumed: `packtool.loader.probe` (`packtool audit
--probe MODEL`) and `check_isolation` run the model and compare; docs/isolation.md has the table.

`one_document_per_row(mb)` is the fallback for a model that cannot read boundaries (a recurrent
layer without its kernel): each document becomes its own right-padded row, so nothing is carried
across documents, at the cost of padding. Targets and the loss normaliser are unchanged::

    input_ids      [[a0 a1 a2], [b0 b1 0]]     attention_mask [[1 1 1], [1 1 0]]
    labels         [[-100 a1 a2], [-100 b1 -100]]
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from packtool.errors import DatasetError
from packtool.labels import IGNORE_INDEX
from packtool.loader.attention import document_ids, flex_document_mask
from packtool.loader.collate import MicroBatch

__all__ = [
    "FEEDS",
    "decoder_layers",
    "layer_kinds",
    "model_inputs",
    "model_layer_kinds",
    "one_document_per_row",
    "position_ids_only",
    "seq_idx",
    "uses_mrope",
    "varlen_kwargs",
]

# Layer types as transformers names them in `config.layer_types` (and what a config without the
# list implies). Recurrent kinds carry a state from token to token, so a packed row needs the
# boundaries inside their kernels, not just in an attention mask.
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
RECURRENT_KINDS = ("linear_attention", "mamba", "conv", "mamba1", "lightning_attention", "rg_lru", "rwkv")
# What a model runs, by the class of each decoder layer's token mixer (first match wins: Mamba-2
# mixers before the Mamba-1 name they contain). linear_attention (Gated DeltaNet) reads cu_seq_lens,
# mamba (Mamba-2) and conv (LFM2) read seq_idx, with their CUDA kernels; the last four read no
# boundary at all, in any kernel transformers calls.
MIXER_KINDS = (
    ("GatedDeltaNet", "linear_attention"),
    ("Mamba2Mixer", "mamba"),  # Mamba-2, Nemotron-H
    ("BambaMixer", "mamba"),
    ("FalconH1Mixer", "mamba"),
    ("GraniteMoeHybridMambaLayer", "mamba"),
    ("Zamba2MambaMixer", "mamba"),
    ("ShortConv", "conv"),  # LFM2
    ("MambaMixer", "mamba1"),  # Mamba, Jamba, Falcon-Mamba: mamba_inner_fn takes no seq_idx
    ("LightningAttention", "lightning_attention"),  # MiniMax
    ("Rglru", "rg_lru"),  # RecurrentGemma
    ("RwkvSelfAttention", "rwkv"),
)
# Model types whose layers are all Mamba-2 / Mamba mixers (no `layer_types` in their configs).
MAMBA_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba")
# The hybrid configs that name their recurrent layers "mamba" in `layers_block_type`.
MAMBA_KIND_NAMES = ("mamba", "mamba2", "mamba_2")
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text")


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def layer_kinds(config: Any) -> tuple[str, ...]:
    """The layer type of each decoder layer: full_attention, sliding_attention, linear_attention, mamba.

    Read from `config.layer_types` (or `layers_block_type` in older hybrids); a config without
    either is all full attention, or sliding when it sets a `sliding_window` and uses it.
    """
    text = _text_config(config)
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    if getattr(text, "model_type", "") in MAMBA_MODEL_TYPES:
        return ("mamba",) * n
    names = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    # Bamba and Granite-4 call their Mamba-2 mixers "linear_attention"; their configs give them away.
    mamba_mixers = hasattr(text, "mamba_d_state")
    if names:
        return tuple(
            "mamba"
            if str(k) in MAMBA_KIND_NAMES or (mamba_mixers and k == "linear_attention")
            else _attention_name(str(k))
            for k in names
        )
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return ("sliding_attention" if sliding else "full_attention",) * n


def decoder_layers(model: Any) -> Sequence[Any]:
    """The text decoder's layers (the ModuleList as long as num_hidden_layers, outside any vision tower)."""
    n = int(getattr(_text_config(model.config), "num_hidden_layers", 0) or 0)
    found: list[Any] = [
        module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and "vis" not in name
    ]
    return found[-1] if found else ()


_RUN_KINDS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def model_layer_kinds(model: Any) -> tuple[str, ...]:
    """The layer type of each decoder layer as the model runs it: its token mixer's class, else the config's name.

    Config names mislead: Nemotron-H calls its Mamba-2 layers linear_attention, RWKV has no
    `layer_types` at all. A model without modules (a config stub) gets `layer_kinds(config)`.
    """
    if not isinstance(model, torch.nn.Module):
        return layer_kinds(model.config)
    if model not in _RUN_KINDS:
        named = layer_kinds(model.config)
        kinds = []
        for i, layer in enumerate(decoder_layers(model)):
            classes = [type(m).__name__ for m in layer.modules()]
            mixer = next((kind for part, kind in MIXER_KINDS if any(part in c for c in classes)), None)
            kinds.append(mixer or (named[i] if i < len(named) else "full_attention"))
        _RUN_KINDS[model] = tuple(kinds) or named
    return _RUN_KINDS[model]


def _attention_name(kind: str) -> str:
    # Falcon-H1 names every layer "hybrid": attention and a Mamba-2 mixer side by side; the mixer
    # is the part that carries a state across a boundary, so it is what the layer is reported as.
    return {"attention": "full_attention", "hybrid": "mamba"}.get(kind, kind)


def uses_mrope(config: Any) -> bool:
    """Multimodal rotary positions (t, h, w) that take [4, B, T] position_ids for packed text."""
    text = _text_config(config)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return getattr(config, "model_type", "") in MROPE_MODEL_TYPES or "mrope_section" in rope


def seq_idx(mb: MicroBatch) -> torch.Tensor:
    """[1, T] int32 document index of every token: what Mamba-2 and causal-conv1d kernels read."""
    return document_ids(mb.cu_seqlens, mb.n_tokens)[None]


def varlen_kwargs(mb: MicroBatch) -> dict[str, Any]:
    """The boundary arguments of `torch.nn.attention.varlen.varlen_attn` (CUDA; q/k/v are the caller's)."""
    cu = mb.cu_seqlens.to(torch.int32)
    return {"cu_seq_q": cu, "cu_seq_k": cu, "max_q": mb.max_seqlen, "max_k": mb.max_seqlen}


def flex_block_mask(mb: MicroBatch, device: torch.device | str | None = None):
    """The document-causal FlexAttention `BlockMask` of the row, on `device` (the row's by default)."""
    return flex_document_mask(mb.cu_seqlens, mb.n_tokens, device=device or mb.input_ids.device)


def position_ids_only(mb: MicroBatch, model: Any) -> dict[str, Any]:
    """Restarting positions and nothing else: what the HF path fed before explicit boundaries.

    Kept as a named feed so the probe can show what it misses (recurrent layers, mRoPE).
    """
    return {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "attention_mask": None, "use_cache": False}


def model_inputs(mb: MicroBatch, model: Any) -> dict[str, Any]:
    """A model's forward kwargs for a packed micro-batch: the boundaries each of its layer types reads.

    Labels are not included (a Trainer batch adds `labels=mb.labels`). Tensors stay on the
    micro-batch's device; move the micro-batch first (`mb.to(device)`).
    """
    config = model.config
    kinds = set(model_layer_kinds(model))
    backend = str(getattr(config, "_attn_implementation", None) or "eager")
    inputs = position_ids_only(mb, model)
    if uses_mrope(config):
        # the text row (restarting per document) is what the model finds documents by; t/h/w place the image tokens
        spatial = mb.mrope_position_ids
        if spatial is None:
            spatial = mb.position_ids[None].expand(3, *mb.position_ids.shape)
        inputs["position_ids"] = torch.cat([mb.position_ids[None], spatial])
    images = mb.vision_inputs()
    if images:
        if "pixel_values" not in inspect.signature(model.forward).parameters:
            raise DatasetError(
                f"the micro-batch holds {len(images['image_grid_thw'])} images and {type(model).__name__}'s forward "
                "takes no pixel_values: train a vision build on its vision-language model"
            )
        inputs.update(images)
    if "flash" in backend or "linear_attention" in kinds:
        inputs.update(mb.flash_kwargs())
    if kinds & {"mamba", "conv"}:
        inputs["seq_idx"] = seq_idx(mb)
    if backend == "flex_attention":
        inputs["attention_mask"] = flex_block_mask(mb)
    return inputs


def one_document_per_row(mb: MicroBatch, model: Any = None) -> dict[str, Any]:
    """Each document of the row as its own right-padded row (the fallback for models that leak).

    Right padding never reaches a real token (causal attention, left-to-right recurrence) and its
    labels are -100, so the targets, and the number the loss divides by, are those of the packed row.
    """
    if mb.vision_inputs() or mb.mrope_position_ids is not None:
        raise DatasetError(
            "one document per row has no place for a vision build's images and mRoPE positions: feed "
            "model_inputs(mb, model), which keeps a Qwen-VL model's packed documents apart (docs/isolation.md)"
        )
    bounds = mb.cu_seqlens.tolist()
    lengths = [hi - lo for lo, hi in itertools.pairwise(bounds)]
    rows, width = len(lengths), max(lengths)
    device = mb.input_ids.device
    input_ids = torch.zeros(rows, width, dtype=mb.input_ids.dtype, device=device)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=mb.labels.dtype, device=device)
    attention_mask = torch.zeros(rows, width, dtype=torch.long, device=device)
    for row, (lo, n) in enumerate(zip(bounds, lengths, strict=False)):
        input_ids[row, :n] = mb.input_ids[0, lo : lo + n]
        labels[row, :n] = mb.labels[0, lo : lo + n]
        attention_mask[row, :n] = 1
    position_ids = torch.arange(width, device=device).expand(rows, width)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "use_cache": False,
    }


# Named ways to feed a packed micro-batch to a model: what the probe compares and the CLI accepts.
FEEDS: dict[str, Callable[[MicroBatch, Any], dict[str, Any]]] = {
    "model_inputs": model_inputs,
    "position_ids": position_ids_only,
    "one_document_per_row": one_document_per_row,
}
