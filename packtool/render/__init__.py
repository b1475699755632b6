"""Render an Example with a chat template and track, for every character, whose it is and whether it is trained.

One render, two views. Each message's content (whitespace-trimmed core) is wrapped in a pair of
private-use sentinel characters that carry the message index, the template runs once with the
marked messages, the sentinels are cut out, and their positions become content spans. The
template also runs on the unmarked messages and the two texts must be byte-identical: a template
that rewrites content (strips, splits, reorders it) is caught here instead of yielding a
shifted mask.

    messages  = [user "Hi", assistant "Hello!"]
    marked    = <|im_start|>user\\n⟦0 Hi 0⟧<|im_end|>\\n<|im_start|>assistant\\n⟦1 Hello! 1⟧<|im_end|>\\n
    text      = <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
    targets   =                                                      ^^^^^^^^^^^^^^^^   (content + end marker)

An assistant target starts right after the assistant header the template prints for
`add_generation_prompt` (so tool calls and think blocks that follow the header are trained),
and ends after the first end-of-turn marker behind the content. Templates that carry
`{% generation %}` blocks define targets themselves, exactly as transformers'
`return_assistant_tokens_mask` reads them.

The modules: `reference` (the render above in about a hundred lines: mark, render with jinja2,
strip, check, targets), `routes` (the accelerated routes to the same result, behind `render_chat`),
`accelerators` (what the routes learn, held by the encode stages, and the switch that turns them
off), `skeletons` and `recipes` (two of those routes), `marks` (sentinels and the record's strings),
`targets` (which characters are trained), `example` (a record of either kind), `injections`.
"""

from packtool.render.example import render_example, render_text
from packtool.render.injections import template_injections
from packtool.render.marks import data_strings
from packtool.render.routes import render_chat
from packtool.render.targets import trained_messages

__all__ = ["data_strings", "render_chat", "render_example", "render_text", "template_injections", "trained_messages"]
