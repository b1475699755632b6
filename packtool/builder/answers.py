"""Pairs and groups: every answer of a preference pair or completion group encoded after one shared prompt.

Every answer of an item is rendered after the same prompt, so its segments share the prompt tokens:

    pair "p7":   prompt = [system, user "2+2?"]   chosen = [assistant "4"]   rejected = [assistant "5"]

    segment 0 (chosen)     P P P P P P h  4* E*        P: prompt tokens, h: the assistant header,
    segment 1 (rejected)   P P P P P P h  5* E*        *: targets (the answer and its end marker)

builder.stages cuts the segments jointly to fit one pack (truncate_item) and stores them with item_roles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from packtool.builder.store import SegmentRole
from packtool.chat_templates import ChatTemplate
from packtool.config import TrainPolicy
from packtool.encode import TextTokenizer, encode_batch
from packtool.errors import RecordError
from packtool.packing_items import KIND_CODES
from packtool.records import (
    CompletionGroup,
    Messages,
    PreferencePair,
    Rendered,
    Tokenized,
    answer_example,
    prompt_length,
)
from packtool.render import render_example
from packtool.render.accelerators import Accelerators


def item_roles(item: PreferencePair | CompletionGroup) -> tuple[SegmentRole, ...]:
    """The stored role of each answer's segment: chosen, rejected; or completion i with its floats."""
    if isinstance(item, PreferencePair):
        return (SegmentRole(KIND_CODES["chosen"]), SegmentRole(KIND_CODES["rejected"]))
    nan = (float("nan"),) * len(item.completions)
    return tuple(
        SegmentRole(KIND_CODES["completion"], i, reward, advantage)
        for i, (reward, advantage) in enumerate(zip(item.rewards or nan, item.advantages or nan))
    )


def encode_answers(
    item: PreferencePair | CompletionGroup,
    template: ChatTemplate | None,
    tokenizer: TextTokenizer,
    policy: TrainPolicy = TrainPolicy(),
    *,
    special_tokens: str = "escape",
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    accelerators: Accelerators | None = None,
) -> tuple[Tokenized, ...]:
    """One Tokenized per answer (chosen, rejected; or each completion), all with the same prompt tokens.

    Each answer is rendered as prompt + answer by `render_example` and tokenized by
    `encode_batch`; the targets are the answer's assistant content and, when
    `policy.end_of_turn`, its end marker. Raises RecordError when a render fails or when the
    renders do not agree on the prompt tokens (a template whose prompt text depends on the
    answer would break the shared prompt cut).

    Plain-string items without a template are text continuations: `prompt + answer` as a
    document whose targets start at the answer.
    """
    if template is None and not item.is_text:
        raise RecordError("no chat template is configured for a chat preference record", kind="template_error")
    try:
        rendered = [
            _render_answer(item, answer, template, tokenizer, policy, add_bos, add_eos, accelerators)
            for answer in item.answers
        ]
    except RecordError as error:
        error.sample_id = error.sample_id or item.id
        raise
    encoded = encode_batch(
        [(r, special_tokens) for r in rendered],
        tokenizer,
        add_bos=bool(add_bos),
        add_eos=bool(add_eos),
    )
    segments = []
    for result in encoded:
        if isinstance(result, RecordError):
            raise result
        segments.append(result)
    _check_shared_prompt(segments, item.id)
    return tuple(segments)


def _render_answer(
    item: PreferencePair | CompletionGroup,
    answer: Messages,
    template: ChatTemplate | None,
    tokenizer: TextTokenizer,
    policy: TrainPolicy,
    add_bos: bool | None,
    add_eos: bool | None,
    accelerators: Accelerators | None,
) -> Rendered:
    example = answer_example(item, answer, chat=template is not None)
    rendered = render_example(
        example, template, tokenizer.config, policy, add_bos=add_bos, add_eos=add_eos, accelerators=accelerators
    )
    if template is not None:
        return rendered
    prompt = item.prompt[0].content
    # render_text trains every character; a continuation trains the answer (and EOS as its end marker).
    (content_start, content_end) = rendered.content_ranges[0]
    end = len(rendered.text) if policy.end_of_turn else content_end
    return replace(rendered, target_ranges=((content_start + len(prompt), end, -1),))


def _check_shared_prompt(segments: Sequence[Tokenized], item_id: str) -> None:
    first = segments[0]
    n = prompt_length(first)
    for k, other in enumerate(segments[1:], start=1):
        if prompt_length(other) != n or not np.array_equal(first.input_ids[:n], other.input_ids[:n]):
            raise RecordError(
                f"answer {k} tokenizes the prompt differently from answer 0 (the template or the tokenizer "
                "merges prompt and answer), so the answers cannot share one prompt cut",
                kind="prompt_mismatch",
                sample_id=item_id,
            )
        if other.n_targets == 0:
            raise RecordError(f"answer {k} has no target token", kind="no_targets", sample_id=item_id)
    if first.n_targets == 0:
        raise RecordError("answer 0 has no target token", kind="no_targets", sample_id=item_id)
