"""Which characters of a checked render are trained: each trained turn from its header (or its generation
block) through its end marker; and the checks that a conversation's tools and calls reached the text."""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from packtool.chat_templates import ChatTemplate
from packtool.config import TrainPolicy
from packtool.errors import RecordError
from packtool.records import Example, Message


def trained_messages(messages: tuple[Message, ...], policy: TrainPolicy) -> list[bool]:
    """Which messages are targets: the role policy, `last` vs `all` turns, then the per-message override."""
    trained = [m.role in policy.roles and m.role != "tool" for m in messages]
    if not policy.tool_calls:
        trained = [t and not m.tool_calls for t, m in zip(trained, messages)]
    if policy.turns == "last":
        last = max((i for i, t in enumerate(trained) if t), default=None)
        trained = [i == last for i in range(len(messages))]
    return [m.train if m.train is not None and m.role != "tool" else t for t, m in zip(trained, messages)]


def _check_tools_printed(example: Example, turns: _Turns) -> None:
    """Every tool definition's name and parameter names, and every tool call's name and argument
    values, must reach the text, as message contents must. Templates re-serialize JSON (key order,
    spacing, quoting), so the pieces are compared, not the JSON.

    A call is looked for between the contents of its neighbours, so the tool definitions or the
    user's words cannot stand in for it; definitions anywhere outside message contents and calls. A
    call's region starts no earlier than its turn's header: a neighbour with an empty content marks
    no place, and the region would reach back over the tool definitions.
    """
    text = turns.text
    spans = sorted((s, e, i) for i, ranges in turns.contents.items() for s, e in ranges)
    regions = {}
    for i, message in enumerate(example.messages):
        if message.tool_calls:
            # neighbours in print order: a template may print an earlier message later (Mistral's system prompt)
            upper = min((s for s, _, k in spans if k > i), default=len(text))
            lower = max((e for _, e, k in spans if k < i and e <= upper), default=0)
            turn = turns.turn_at(i)
            regions[i] = (turn if lower < turn <= upper else lower, upper)
    # Definitions: outside every content and every call's region, so neither stands in for them.
    cuts = sorted([*((s, e) for s, e, _ in spans), *regions.values()])
    kept, at = [], 0
    for start, end in cuts:
        kept.append(text[at:start] if start > at else "")
        at = max(at, end)
    outside = "\0".join([*kept, text[at:]])
    # Templates print the tools in order, so each search starts where the previous name was found
    # (and only then looks from the start): searching all of a 4 MB render for each of 25,000 tools took 60 s.
    hint = 0
    for j, tool in enumerate(example.tools or ()):
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = function.get("name") if isinstance(function, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        pieces = [name, *(properties if isinstance(properties, dict) else ())]
        found = [_printed_at(p, outside, hint) if isinstance(p, str) and p else 0 for p in pieces]
        missing = [p for p, at in zip(pieces, found) if at < 0]
        hint = found[0] if found and found[0] > 0 else hint
        if missing:
            raise RecordError(
                f"the template does not print tool definition {name!r} (tools[{j}]): "
                f"{', '.join(map(repr, missing[:3]))} missing from the render, so the model would be trained "
                "to call a tool it never saw",
                kind="template_dropped_tools",
            )
    for i, message in enumerate(example.messages):
        if not message.tool_calls:
            continue
        region = text[slice(*regions[i])]
        for j, call in enumerate(message.tool_calls):
            function = call.get("function", {})
            pieces = [function.get("name"), *_leaves(function.get("arguments"))]
            missing = [p for p in pieces if p is not None and p != "" and _printed_at(p, region) < 0]
            if missing:
                raise RecordError(
                    f"the template does not print tool call {j} of message {i} ({message.role}): "
                    f"{', '.join(repr(p) for p in missing[:3])} missing from the render",
                    kind="template_dropped_tools",
                )


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _printed_at(value: Any, text: str, hint: int = 0) -> int:
    """Where a value appears in text as a template would print it (raw, JSON escaped or not, or
    Python), looked for from `hint` first; -1 when it does not appear. Whether it appears does not depend
    on which form is tried first, so the form most templates print (the value as it is) goes first, alone:
    the other forms cost two JSON encodings per value (a third of a Qwen3 tool-call render)."""
    at = text.find(str(value), hint, hint + (1 << 16))
    if at >= 0:
        return at
    forms = {str(value), json.dumps(value), json.dumps(value, ensure_ascii=False)}
    if isinstance(value, str):
        forms |= {form[1:-1] for form in forms if form.startswith('"')} | {repr(value)[1:-1]}
    # the 64 KiB after the hint first: a form the template does not use would otherwise be looked for to the end
    for start, end in ((hint, hint + (1 << 16)), (0, len(text))):
        for form in forms:
            at = text.find(form, start, end)
            if at >= 0:
                return at
    return -1


def _block_owners(
    generations: list[tuple[int, int]], contents: dict[int, list[tuple[int, int]]], roles: list[str]
) -> list[list[int]]:
    """The messages whose turn each `{% generation %}` block is: those whose content it holds.

    A block without content (an assistant turn that only calls tools) belongs to a content-less
    assistant message between its printed neighbours; without this, such blocks were trained even
    under `turns: last` or `tool_calls: false`. An empty tool result leaves two such turns between
    the same neighbours: the k-th content-less block there is the k-th content-less assistant there,
    when the numbers agree (else the block has no owner and is trained).
    """
    owners: list[list[int]] = []
    gaps: dict[tuple[int, int], list[int]] = {}
    for k, (start, end) in enumerate(generations):
        owners.append([i for i, ranges in contents.items() for s, e in ranges if start <= s and e <= end])
        if not owners[-1]:
            before = max((i for i, r in contents.items() if r[-1][1] <= start), default=-1)
            after = min((i for i, r in contents.items() if r[0][0] >= end), default=len(roles))
            gaps.setdefault((before, after), []).append(k)
    for (before, after), blocks in gaps.items():
        silent = [i for i in range(before + 1, after) if roles[i] == "assistant" and i not in contents]
        if len(silent) == len(blocks):
            for k, i in zip(blocks, silent):
                owners[k] = [i]
    return owners


def _targets_from_generation_blocks(
    generations: list[tuple[int, int]], owners: list[list[int]], trained: list[bool]
) -> list[tuple[int, int, int]]:
    return [
        (start, end, mine[0] if mine else -1)
        for (start, end), mine in zip(generations, owners)
        if not mine or any(trained[i] for i in mine)
    ]


class _Turns:
    """Where each message's turn lies in a render, from the contents around it (an empty or
    whitespace-only content has no range, so it anchors nothing).

    `lower`: the last content end before a place. `header_at`: where an assistant message's generation
    header starts. A message with a content owns the last header before it. One without (a turn that
    only calls tools) has nothing of its own to search back from, and the gap between the contents
    around it can hold several turns: an empty tool result puts the next answer's header in the same
    gap. Each assistant message prints one header, in order, so the k-th assistant of the gap owns
    its k-th header; a gap with another number of headers than assistants (counting the one whose
    content closes it) locates none of its messages.

        user "Hi" | assistant, a call | tool "" | assistant "Done"
        Hi⟧<|im_end|>\\n<|im_start|>assistant\\n<tool_call>...<|im_end|>\\n<|im_start|>user\\n<tool_response>
        \\n\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n⟦Done
        gap (0, 3): headers at message 1's turn and message 3's; message 1 is the gap's first assistant
    """

    def __init__(
        self,
        text: str,
        messages: tuple[Message, ...],
        contents: dict[int, list[tuple[int, int]]],
        header: str | None,
        skip: tuple[tuple[int, int], ...],
        blocks: dict[int, int],
    ) -> None:
        self.text, self.messages, self.contents, self.header, self.skip = text, messages, contents, header, skip
        self.blocks = blocks
        self.ends = sorted(e for ranges in contents.values() for _, e in ranges)
        # which messages have contents, and how many of those before each index are assistants: built on
        # first use, as most renders have no turn without a content
        self.anchored: list[int] = []
        self.assistants: list[int] = []
        self.gaps: dict[tuple[int, int], list[int]] = {}

    def lower(self, i: int, upper: int) -> int:
        """The last content end at or before `upper` that is not message i's own (0 without one)."""
        below = bisect.bisect_right(self.ends, upper)
        own = self.contents.get(i)
        while own and below and self.ends[below - 1] == own[0][1]:
            below -= 1
        return self.ends[below - 1] if below else 0

    def turn_at(self, i: int) -> int:
        """Where message i's turn starts: its first `{% generation %}` block, or for an assistant its
        header; -1 where it cannot be told."""
        if i in self.blocks:
            return self.blocks[i]
        return self.header_at(i) if self.messages[i].role == "assistant" else -1

    def header_at(self, i: int) -> int:
        """Where message i's header starts; -1 where it cannot be told."""
        if self.header is None:
            return -1
        own = self.contents.get(i)
        if own:
            return _rfind_structure(self.text, self.header, self.lower(i, own[0][0]), own[0][0], self.skip)
        if not self.assistants:
            self.anchored = sorted(self.contents)
            self.assistants = list(accumulate((m.role == "assistant" for m in self.messages), initial=0))
        k = bisect.bisect_left(self.anchored, i)
        before = self.anchored[k - 1] if k else -1
        after = self.anchored[k] if k < len(self.anchored) else len(self.messages)
        closing = after < len(self.messages) and self.messages[after].role == "assistant"
        found = self._gap(before, after, self.header)
        if len(found) != self.assistants[after] - self.assistants[before + 1] + closing:
            return -1
        return found[self.assistants[i] - self.assistants[before + 1]]

    def _gap(self, before: int, after: int, header: str) -> list[int]:
        """The headers between message `before`'s last content and message `after`'s first."""
        if (before, after) not in self.gaps:
            lower = self.contents[before][-1][1] if before >= 0 else 0
            upper = self.contents[after][0][0] if after < len(self.messages) else len(self.text)
            found: list[int] = []
            at = self.text.find(header, lower, upper) if lower <= upper else -1
            while at >= 0:
                if not _in_any(at, self.skip):
                    found.append(at)
                at = self.text.find(header, at + 1, upper)
            self.gaps[before, after] = found
        return self.gaps[before, after]


def _targets_from_headers(
    turns: _Turns,
    trained: list[bool],
    template: ChatTemplate,
    policy: TrainPolicy,
) -> list[tuple[int, int, int]]:
    """Targets from the assistant header and the first end-of-turn marker; markers and headers that a
    record spells (turns.skip: literal_ranges) are data, never structure."""
    text, messages, contents, literal_ranges = turns.text, turns.messages, turns.contents, turns.skip
    starts = sorted((s, i) for i, ranges in contents.items() for s, _ in ranges)
    positions = [s for s, _ in starts]
    # Where the first content of a later message starts, for each message (bisect and this keep the
    # search per message logarithmic: scanning every content for every message took 183 s for 30,000)
    later = [len(text)] * (len(messages) + 1)
    first = {}
    for s, j in reversed(starts):
        first[j] = s
    for j in range(len(messages) - 1, -1, -1):
        later[j] = min(later[j + 1], first.get(j + 1, len(text)))
    targets = []
    for i, message in enumerate(messages):
        if not trained[i]:
            continue
        ranges = contents.get(i, [])
        if len(ranges) > 1:
            raise RecordError(
                f"the template prints message {i} ({message.role}) {len(ranges)} times; "
                "cannot tell which copy to train",
                kind="mask_check",
            )
        own = ranges[0] if ranges else None
        upper = own[0] if own else later[i]
        if message.role == "assistant" and template.generation_header:
            header_at = turns.header_at(i)
            start = header_at + len(template.generation_header) if header_at >= 0 else (own[0] if own else -1)
        else:
            start = own[0] if own else -1
            # Without a header, the content's own leading whitespace (kept outside the sentinels)
            # starts the target: BPE glues it to the next word (" Paris"), a token the target would
            # otherwise start inside of (encode counts such a token as straddling).
            lead = message.content[: len(message.content) - len(message.content.lstrip())]
            lower = turns.lower(i, upper)
            if own and lead and own[0] - len(lead) >= lower and text[own[0] - len(lead) : own[0]] == lead:
                start = own[0] - len(lead)
        if start < 0:
            raise RecordError(
                f"cannot locate message {i} ({message.role}) in the rendered text; the template "
                "drops it or prints it without an assistant header",
                kind="mask_check",
            )
        search_from = own[1] if own else start
        after = bisect.bisect_left(positions, search_from)  # the first content from search_from on, not its own
        while after < len(starts) and starts[after][1] == i:
            after += 1
        limit = starts[after][0] if after < len(starts) else len(text)
        end = _end_of_turn(
            text, search_from, limit, template.end_markers, include=policy.end_of_turn, skip=literal_ranges
        )
        if end is None:
            if not policy.end_of_turn and own:
                end = own[1]
            else:
                raise RecordError(
                    f"no end-of-turn marker ({', '.join(template.end_markers[:3])}, ...) after "
                    f"message {i} ({message.role})",
                    kind="mask_check",
                )
        targets.append((start, end, i))
    return targets


def _in_any(at: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return bool(ranges) and any(start <= at < end for start, end in ranges)


def _rfind_structure(text: str, needle: str, lower: int, upper: int, skip: tuple[tuple[int, int], ...]) -> int:
    at = text.rfind(needle, lower, upper)
    while at >= 0 and _in_any(at, skip):
        at = text.rfind(needle, lower, at)
    return at


def _end_of_turn(
    text: str,
    start: int,
    limit: int,
    markers: tuple[str, ...],
    *,
    include: bool,
    skip: tuple[tuple[int, int], ...] = (),
) -> int | None:
    """Where the first end marker in text[start:limit] starts (or ends, with `include`); None without one.
    Of markers starting at one place, the smallest string. Markers starting in a `skip` range are data,
    not structure."""
    pattern = _any_marker(markers)
    found = pattern.search(text, start, limit)
    while found is not None and _in_any(found.start(), skip):
        found = pattern.search(text, found.start() + 1, limit)
    if found is None:
        return None
    return found.end() if include else found.start()


@functools.cache
def _any_marker(markers: tuple[str, ...]) -> re.Pattern[str]:
    """One search for all the markers (a find per marker was ~8 us of a Qwen3 tool-calling render): a
    regex tries its alternatives in order at the leftmost place any matches, so the smallest string
    goes first."""
    return re.compile("|".join(map(re.escape, sorted(set(markers)))) or "(?!)")  # none: a pattern never found
