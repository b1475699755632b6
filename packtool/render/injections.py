"""The text a template puts into every sample whatever the data (a default system prompt, date lines)."""

from __future__ import annotations

from typing import Any

import jinja2

from packtool.chat_templates import ChatTemplate
from packtool.errors import TemplateRaised
from packtool.template_limits import TemplateLimit
from packtool.template_tracking import open_mark

_ROLE_WORDS = {"system", "user", "assistant", "model", "tool", "ipython", "function", "developer"}


def template_injections(template: ChatTemplate, tokenizer: Any = None) -> list[str]:
    """Text the template puts into every sample whatever the data: a default system prompt, date lines.

    What a conversation without a system message gets before its first user turn, less the user
    header itself (the part every later user turn repeats), split at special tokens and lines:

        [user x, assistant y]  ->  <|im_start|>system\\nYou are Qwen, ...<|im_end|>\\n<|im_start|>user\\n x ...
        [.. , user z, ..]       ->                          ... y<|im_end|>\\n<|im_start|>user\\n z ...
        injected                =  ["You are Qwen, ..."]   (role names and special tokens are structure)

    `tokenizer` (a packtool.encode.TextTokenizer, optional) supplies its special tokens when the
    template's list lacks them.
    """
    x, y, z, w = (open_mark(i) for i in range(4))  # characters no template prints on its own
    one = [{"role": "user", "content": x}, {"role": "assistant", "content": y}]
    two = [*one, {"role": "user", "content": z}, {"role": "assistant", "content": w}]
    try:
        first = template.render(one, None)
        second = template.render(two, None)
    except (TemplateRaised, TemplateLimit, jinja2.TemplateError):
        return []
    at_x, at_y, at_z = first.find(x), second.find(y), second.find(z)
    if min(at_x, at_y, at_z) < 0:
        return []
    preamble, user_header = first[:at_x], second[at_y + 1 : at_z]
    common = 0
    while common < min(len(preamble), len(user_header)) and preamble[-1 - common] == user_header[-1 - common]:
        common += 1
    cut = len(preamble) - common
    pattern = getattr(tokenizer, "special_literals", None) or template.literals
    # a suffix shared inside a special token (`<s>[INST]` vs `</s>[INST]`) does not split it
    for literal in pattern.finditer(preamble) if pattern is not None else ():
        if literal.start() < cut < literal.end():
            cut = literal.start()
    before = preamble[:cut]
    pieces = pattern.split(before) if pattern is not None else [before]
    lines = [line.strip() for piece in pieces for line in piece.splitlines()]
    return [line for line in lines if line and line.lower() not in _ROLE_WORDS]
