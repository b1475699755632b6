"""The image rows of `packtool audit --probe`: do packed image documents stay apart in a Qwen-VL model?

A vision build's micro-batch holds documents with images beside text-only ones; the model reads
the images through its vision tower and the positions through `model_inputs` (the text row, then
t, h, w). On a tiny random Qwen2-VL, Qwen2.5-VL or Qwen3-VL, three documents::

    document 0   text 5, image (1, 4, 6), text 3, image (1, 2, 2), text 2
    document 1   text 9
    document 2   text 3, image (1, 6, 4), text 5

are run packed (one row, `model_inputs`) and each alone through the model's own path (`input_ids`,
`mm_token_type_ids`, `pixel_values`, `image_grid_thw`: the model computes its positions), and compared:

    check           what is compared                                                          leak when
    image_logits    each document's logits packed vs alone                                      > tol
    vision_outputs  the vision tower's output for each image, packed vs its document alone      > tol
    vision_grads    d(a document's logits)/d(vision parameters), packed vs alone (relative)     > tol
    image_change    change document 0's first image: logits of documents 1.. must not move      > tol

The tolerances are the text probe's (`probe.tolerance`): eager's float32 softmax recomputes in
shapes that differ alone and packed, so the first three take its looser one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from packtool.loader.boundaries import model_inputs
from packtool.loader.collate import LoadedPack, MicroBatch, collate
from packtool.loader.probe import FIRST_ID, CheckResult, ProbeRow, tolerance
from packtool.loader.vision import PackImages

IMAGE_CHECKS = ("image_logits", "vision_outputs", "vision_grads", "image_change")
IMAGE_FEED = "model_inputs+images"
# Text lengths and image grids (t, h, w) of the probe's documents: two images with text between them, none, one.
LAYOUTS: tuple[tuple[int | tuple[int, int, int], ...], ...] = (
    (5, (1, 4, 6), 3, (1, 2, 2), 2),
    (9,),
    (3, (1, 6, 4), 5),
)


@dataclass(frozen=True)
class ImageDocument:
    input_ids: torch.Tensor  # [1, n]
    token_types: torch.Tensor  # [1, n]: 1 on image tokens (the processor's mm_token_type_ids)
    pixel_values: torch.Tensor | None  # [patches, C * t * p * p]
    grids: torch.Tensor | None  # [images, 3]

    def alone_inputs(self) -> dict[str, Any]:
        """The document as transformers' processor path gives it to the model."""
        inputs: dict[str, Any] = {
            "input_ids": self.input_ids,
            "mm_token_type_ids": self.token_types,
            "use_cache": False,
        }
        if self.grids is not None:
            inputs.update(pixel_values=self.pixel_values, image_grid_thw=self.grids)
        return inputs


def image_documents(model: Any, seed: int = 0) -> list[ImageDocument]:
    """LAYOUTS with random text ids (never a special token of the model's) and random pixel values."""
    config, vision = model.config, model.config.vision_config
    merge, patch, temporal = vision.spatial_merge_size, vision.patch_size, vision.temporal_patch_size
    special = {getattr(config, k, None) for k in ("image_token_id", "video_token_id")}
    special |= {getattr(config, k, None) for k in ("vision_start_token_id", "vision_end_token_id")}
    vocab = int(config.get_text_config().vocab_size)
    text_ids = np.array([i for i in range(FIRST_ID, vocab) if i not in special])
    rng = np.random.default_rng(seed)
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    documents = []
    for layout in LAYOUTS:
        ids: list[int] = []
        grids = [g for g in layout if isinstance(g, tuple)]
        for segment in layout:
            if isinstance(segment, tuple):
                ids += [config.image_token_id] * (segment[0] * segment[1] * segment[2] // merge**2)
            else:
                ids += rng.choice(text_ids, segment).tolist()
        row = torch.tensor([ids], device=device)
        patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.from_numpy(rng.standard_normal((patches, 3 * temporal * patch * patch))).to(device, dtype)
        documents.append(
            ImageDocument(
                row,
                (row == config.image_token_id).int(),
                pixels if grids else None,
                torch.tensor(grids, device=device) if grids else None,
            )
        )
    return documents


def packed_batch(model: Any, documents: Sequence[ImageDocument]) -> MicroBatch:
    """The documents as a vision build's micro-batch: one pack, each document's positions from the model's own
    get_rope_index on it alone (what the build stores), the images in token order."""
    ids = np.concatenate([d.input_ids[0].cpu().numpy() for d in documents])
    cu = np.cumsum([0, *(d.input_ids.shape[1] for d in documents)])
    labels = ids.copy()
    labels[cu[:-1]] = -100
    mrope = [
        model.model.get_rope_index(d.input_ids, d.token_types, image_grid_thw=d.grids)[0][:, 0].cpu().numpy()
        for d in documents
    ]
    with_images = [d for d in documents if d.grids is not None]
    images = PackImages(
        torch.cat([d.pixel_values for d in with_images if d.pixel_values is not None]).cpu(),
        torch.cat([d.grids for d in with_images if d.grids is not None]).cpu(),
        np.concatenate(mrope, axis=1),
    )
    return collate([LoadedPack(ids, labels, cu, images=images)])


class _VisionOutputs:
    """The vision tower's merged output of every forward run while it is held."""

    def __init__(self, model: Any) -> None:
        self.outputs: list[torch.Tensor] = []
        self._handle = model.model.visual.register_forward_hook(self._keep)

    def _keep(self, _module: Any, _args: Any, output: Any) -> None:
        self.outputs.append(output.pooler_output.detach())

    def __enter__(self) -> _VisionOutputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


def _vision_grads(model: Any, inputs: dict[str, Any], lo: int, hi: int) -> torch.Tensor:
    """d(mean square of the logits of tokens lo:hi)/d(vision parameters), flattened."""
    parameters = list(model.model.visual.parameters())
    logits = model(**inputs).logits[0, lo:hi]
    grads = torch.autograd.grad(logits.double().square().mean(), parameters, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, parameters)])


def image_row(model: Any) -> ProbeRow:
    """The four image checks on one model (its backend already set), fed by `model_inputs`."""
    backend = str(model.config._attn_implementation)
    documents = image_documents(model)
    device = next(model.parameters()).device
    mb = packed_batch(model, documents).to(device)
    bounds = mb.cu_seqlens.tolist()
    try:
        with torch.no_grad(), _VisionOutputs(model) as seen:
            alone = [model(**d.alone_inputs()).logits[0].double() for d in documents]
            alone_vision = torch.cat(seen.outputs)
            seen.outputs.clear()
            inputs = model_inputs(mb, model)
            packed = model(**inputs).logits[0].double()
            packed_vision = torch.cat(seen.outputs)
            changed = mb.pixel_values.clone()  # type: ignore[union-attr]
            changed[0] += 1.0  # a patch of document 0's first image
            moved = model(**{**inputs, "pixel_values": changed}).logits[0].double()
        grads = [
            (_vision_grads(model, inputs, lo, hi), _vision_grads(model, d.alone_inputs(), 0, hi - lo))
            for d, lo, hi in zip(documents, bounds[:-1], bounds[1:], strict=True)
            if d.grids is not None
        ]
    except Exception as err:  # the model refuses the packed image inputs: training on them would fail
        why = (str(err).strip().splitlines() or [""])[0][:200]
        return ProbeRow(
            backend, IMAGE_FEED, "error", detail=f"the packed image inputs fail: {type(err).__name__}: {why}"
        )
    dtype = next(model.parameters()).dtype
    scale = max(max(float(a.abs().max()) for a in alone), torch.finfo(torch.float64).tiny)
    logits = max(float((packed[lo:hi] - a).abs().max()) for a, lo, hi in zip(alone, bounds[:-1], bounds[1:])) / scale
    vision_scale = max(float(alone_vision.abs().max()), torch.finfo(torch.float64).tiny)
    vision = float((packed_vision - alone_vision).double().abs().max()) / vision_scale
    gradient = max(float((p - a).abs().max()) / max(float(a.abs().max()), 1e-300) for p, a in grads)
    others = float((moved[bounds[1] :] - packed[bounds[1] :]).abs().max())
    own = float((moved[: bounds[1]] - packed[: bounds[1]]).abs().max())
    loose, limit = tolerance(dtype, recomputed=True), tolerance(dtype) * scale
    checks = (
        CheckResult("image_logits", logits, logits <= loose),
        CheckResult("vision_outputs", vision, vision <= loose),
        CheckResult("vision_grads", gradient, gradient <= loose),
        CheckResult("image_change", others / scale, others <= limit and own > limit),
    )
    if all(check.ok for check in checks):
        return ProbeRow(backend, IMAGE_FEED, "pass", checks)
    failed = ", ".join(check.check for check in checks if not check.ok)
    return ProbeRow(
        backend,
        IMAGE_FEED,
        "leak",
        checks,
        f"packed image documents differ from each alone ({failed}); fix: feed model_inputs(mb, model) with the "
        "micro-batch of a vision build (the text row restarting per document, then t/h/w)",
    )


# What each tiny vision tower runs (probe.TINY_VISIONS): its attention is per image, by its cu_seqlens.
TOWERS = {
    "qwen2_vl": "2 blocks, full attention within each image",
    "qwen2_5_vl": "2 blocks: windows, then full attention within each image",
    "qwen3_vl": "2 blocks within each image, block 0 feeding the deepstack",
}


def image_table() -> str:
    """docs/isolation.md's image table: the vision-language families (tests/loader/test_vision_probe.py runs each
    row on CPU: every check passes with model_inputs, and without the text row the documents leak)."""
    from packtool.loader.probe import FAMILIES

    lines = [
        "| family | `--probe` | tiny vision tower | `model_inputs` passes | "
        + ", ".join(IMAGE_CHECKS)
        + " (eager, sdpa) | t/h/w positions without the text row |",
        "|---|---|---|---|---|---|",
    ]
    for family in FAMILIES.values():
        if family.model_type in TOWERS:
            lines.append(
                f"| {family.label.split(' (')[0]} | `{family.key}` | {TOWERS[family.model_type]} "
                "| `position_ids` [4, 1, T] (the text row, then the stored t/h/w), `pixel_values`, `image_grid_thw` "
                "| pass | leak |"
            )
    return "\n".join(lines)
