"""The canary's tiny overfit (`packtool canary`): train a model on a handful of packs, then generate.

What runs, in order, all through packtool's own training path:

    build      MODEL as `audit --probe` reads it (a family name, config.json, model folder, cached hub id):
               a tiny random copy (hidden 64, one layer of each kind, the tokenizer's vocabulary) or,
               with weights=True, the real weights
    guard      check_isolation first; a model whose packed path leaks or refuses packed inputs here
               (Qwen3.5's Gated DeltaNet on CPU) trains one document per row instead, with a notice,
               once that feed passes the same guard
    train      N full-batch steps: one micro-batch per pack, model_inputs (or one document per row),
               the chunked token loss from the last hidden states, the window normaliser (sum / N)
    generate   greedy, one document's prompt at a time, exactly n tokens (no stop: the caller checks
               where the turn ends and whether eos would have stopped it there)

    packs = [LoadedPack(ids, labels, cu), ...]            # the canary documents, as the build packed them
    tuned = load_model("llama", vocab_size=4096)
    feed, notices = guarded_feed(tuned.model)             # model_inputs, or one_document_per_row with a notice
    losses = overfit(tuned.model, packs, feed, steps=40)  # the loss curve, one value per step
    greedy(tuned.model, prompt_ids, 12)                   # the 12 tokens it generates
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from packtool.errors import IsolationError, ProbeError
from packtool.loader.boundaries import model_inputs, one_document_per_row
from packtool.loader.collate import LoadedPack, MicroBatch, collate
from packtool.loader.loss import chunked_token_loss_sum, window_norm
from packtool.loader.probe import FAMILIES, build_tiny, check_isolation, load_real, resolve_config

Feed = Callable[[MicroBatch, Any], dict[str, Any]]
# Adam at a constant 1e-2 memorises the quickstart canaries (~850 tokens) in a hidden-64 model in 50 steps
# (8.3 -> 0.10, every answer given back); 5e-3 reaches the same loss but not every answer, and a linear
# decay to 0 stalls at 1.7 in 40 steps. The 1e-4 of a real run would need thousands of steps.
LEARNING_RATE = 1e-2
# A hidden-64 model's matrices are too small to split across threads: one thread trains the quickstart
# canaries at ~0.2 s a step where two took ~1 s (2-core machine, busy); real weights keep torch's setting.
SMALL_MODEL = 10_000_000  # parameters
SEED = 0


@dataclass(frozen=True, slots=True)
class TunedModel:
    """The model the canary trains, and what it is, in words for the report."""

    model: Any
    description: str  # "LlamaForCausalLM, tiny random copy (sdpa, float32)"


def load_model(model: str, *, vocab_size: int, weights: bool = False) -> TunedModel:
    """MODEL as `audit --probe` reads it, in float32 on sdpa (eager where sdpa is refused), in train mode.

    A tiny copy takes the build tokenizer's vocabulary: the canary's token ids are real ids, and a
    tiny vocabulary would fold them together."""
    if weights:
        for backend in ("sdpa", "eager"):
            try:
                real = load_real(model, backend)
            except (ValueError, ImportError) as err:
                last: Exception = err
                continue
            vocab = int(real.config.get_text_config().vocab_size)
            if vocab < vocab_size:  # its embedding would be indexed past its end
                raise ProbeError(
                    f"{model}: vocab_size {vocab} is smaller than the build tokenizer's {vocab_size}: "
                    "not the model this build was tokenized for"
                )
            return TunedModel(real.float().train(), f"{type(real).__name__}, real weights ({backend}, float32)")
        raise ProbeError(f"{model}: its weights could not be loaded ({type(last).__name__}: {last})")
    config = resolve_config(model, tiny=True)
    text = config.get_text_config()
    if int(text.vocab_size) < vocab_size:
        text.vocab_size = vocab_size
    for backend in ("sdpa", "eager"):
        try:
            tiny = build_tiny(config, backend, seed=SEED, dtype=torch.float32)
        except (ValueError, ImportError) as err:
            last = err
            continue
        return TunedModel(tiny.train(), f"{type(tiny).__name__}, tiny random copy ({backend}, float32)")
    raise ProbeError(f"{model}: no tiny copy could be built ({type(last).__name__}: {last})")


def guarded_feed(model: Any) -> tuple[Feed, tuple[str, ...]]:
    """model_inputs when the isolation guard passes; else one document per row, with the guard's reason.

    The fallback must pass the same guard: a model that mixes documents even one per row stops here."""
    try:
        check_isolation(model)
    except IsolationError as err:
        check_isolation(model, feed=one_document_per_row)
        notice = f"packed rows are not isolated here, so the overfit trains one document per row ({err})"
        return one_document_per_row, (notice,)
    return model_inputs, ()


@contextmanager
def _threads_for(model: Any) -> Iterator[None]:
    """One torch thread for a tiny model (see SMALL_MODEL), restored after."""
    before = torch.get_num_threads()
    small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL
    if small:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def overfit(
    model: Any, packs: Sequence[LoadedPack], feed: Feed, *, steps: int, lr: float = LEARNING_RATE
) -> list[float]:
    """`steps` optimizer steps over all `packs` (one window, one micro-batch per pack): the loss before each step.

    The loss of a step is the window's token mean, sum of target losses / targets of the window, as
    window_norm scales it for backward (one rank here)."""
    torch.manual_seed(SEED)
    device = next(model.parameters()).device
    batches = [collate([pack]).to(device) for pack in packs]
    norm = window_norm(batches)
    if norm.skip:
        raise ProbeError("the canary packs hold no target: nothing to overfit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    with _threads_for(model):
        for _ in range(steps):
            losses.append(_step(model, batches, feed, optimizer, norm))
    model.eval()
    return losses


def _step(model: Any, batches: list[MicroBatch], feed: Feed, optimizer: Any, norm: Any) -> float:
    """One optimizer step over every micro-batch of the window; the window's token-mean loss."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for mb in batches:
        inputs = dict(feed(mb, model))
        labels = inputs.pop("labels", mb.labels)
        hidden = decoder(**inputs).last_hidden_state
        loss_sum, _ = chunked_token_loss_sum(hidden, head.weight, labels)
        norm.loss_for_backward(loss_sum).backward()
        total += float(loss_sum.detach())
    optimizer.step()
    return total / norm.n_global


@torch.no_grad()
def greedy(model: Any, prompt: np.ndarray, n: int) -> list[int]:
    """The `n` tokens a greedy decode appends to `prompt`, with no stop token (the caller judges the stop)."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64), device=device)[None]
    with _threads_for(model):
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, ids.shape[1] :]]


def generation_eos(model: str) -> tuple[tuple[int, ...], str] | None:
    """The eos ids generation stops at for MODEL, and the file that says so: generation_config.json, else
    config.json's eos_token_id (what transformers falls back to). None for a family name, or a model that
    names no eos (the tokenizer's eos then decides)."""
    if model in FAMILIES:
        return None
    path = Path(model)
    folder = path if path.is_dir() else path.parent if path.suffix == ".json" and path.exists() else None
    if folder is None:
        return _cached_eos(model)
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ProbeError(f"{file}: not JSON ({err}); fix or remove it") from None
        eos = _eos_ids(raw.get("eos_token_id") if isinstance(raw, dict) else None)
        if eos:
            return eos, str(file)
    return None


def _cached_eos(model: str) -> tuple[tuple[int, ...], str] | None:
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):  # no generation_config.json in the cache: the config's eos then
        return None
    eos = _eos_ids(generation.eos_token_id)
    return (eos, f"{model} generation_config.json") if eos else None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()
