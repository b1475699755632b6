"""Regenerate the vision quickstart: a few tiny pictures, chats about them, and the quickstart's tokenizer with
Qwen2-VL's image tokens, its image processor settings and a vision-language chat template.

    python configs/quickstart_vision/make_quickstart_vision.py    # write everything (byte-identical on a rerun)

    images/*.png        six small pictures drawn here (shapes on a plain background), a few hundred bytes each
    chat.jsonl          {"id", "messages"}: image content parts ({"type": "image", "image": "images/..."}) and
                        LLaMA-Factory's <image> placeholders with an "images" list; text-only chats beside them
    model/              ../quickstart/tokenizer plus <|vision_start|>, <|image_pad|>, <|vision_end|>;
                        preprocessor_config.json (Qwen2-VL's image processor, small pixel bounds: an image is a
                        few dozen tokens) and chat_template.jinja (ChatML that writes an image part as
                        <|vision_start|><|image_pad|><|vision_end|>)

Needs Pillow (`pip install "packtool[vision]"`) and `tokenizers`; no downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw
from tokenizers import AddedToken, Tokenizer

HERE = Path(__file__).resolve().parent
QUICKSTART_TOKENIZER = HERE.parent / "quickstart" / "tokenizer"
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")

# name: (width, height, background, shape, colour): what each picture shows, so its chats can say so
PICTURES = {
    "red-square": (48, 36, "white", "square", "red"),
    "blue-circle": (40, 40, "white", "circle", "blue"),
    "green-stripe": (96, 24, "black", "stripe", "green"),
    "yellow-square": (30, 60, "navy", "square", "yellow"),
    "purple-circle": (64, 48, "lightgrey", "circle", "purple"),
    "orange-stripe": (28, 84, "white", "stripe", "orange"),
}

TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message.role }}
{% if message.content is string -%}
{{ message.content }}
{%- else -%}
{%- for part in message.content -%}
{%- if part.type == 'image' -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'text' -%}
{{ part.text }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

PROCESSOR = {
    "processor_class": "Qwen2VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12544,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def draw(width: int, height: int, background: str, shape: str, colour: str) -> Image.Image:
    picture = Image.new("RGB", (width, height), background)
    pen = ImageDraw.Draw(picture)
    box = (width // 4, height // 4, 3 * width // 4, 3 * height // 4)
    if shape == "circle":
        pen.ellipse(box, fill=colour)
    elif shape == "square":
        pen.rectangle(box, fill=colour)
    else:
        pen.rectangle((0, height // 3, width, 2 * height // 3), fill=colour)
    return picture


def chats() -> list[dict]:
    rows = []
    names = list(PICTURES)
    for i, name in enumerate(names):
        _, _, background, shape, colour = PICTURES[name]
        path = f"images/{name}.png"
        rows.append(
            {
                "id": f"look-{i}",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "image": path}, {"type": "text", "text": "What does it show?"}],
                    },
                    {"role": "assistant", "content": f"A {colour} {shape} on a {background} background."},
                ],
            }
        )
        other = names[(i + 1) % len(names)]
        rows.append(
            {
                "id": f"compare-{i}",
                "messages": [
                    {"role": "system", "content": "Answer in one short sentence."},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Here are two pictures: "},
                            {"type": "image", "image": path},
                            {"type": "text", "text": " and "},
                            {"type": "image", "image": f"images/{other}.png"},
                            {"type": "text", "text": ". Which colours do you see?"},
                        ],
                    },
                    {"role": "assistant", "content": f"{colour.capitalize()} and {PICTURES[other][4]}."},
                ],
            }
        )
        rows.append(
            {
                "id": f"placeholder-{i}",
                "messages": [
                    {"role": "user", "content": "<image>Name the shape."},
                    {"role": "assistant", "content": f"It is a {shape}."},
                    {"role": "user", "content": "And its colour?"},
                    {"role": "assistant", "content": f"{colour.capitalize()}."},
                ],
                "images": [path],
            }
        )
        rows.append(
            {
                "id": f"text-{i}",
                "messages": [
                    {"role": "user", "content": f"Which colour do you get by mixing {colour} with white?"},
                    {"role": "assistant", "content": f"A lighter {colour}."},
                ],
            }
        )
    return rows


def model(folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    tokenizer = Tokenizer.from_file(str(QUICKSTART_TOKENIZER / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in VISION_TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = json.loads((QUICKSTART_TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings.pop("chat_template")  # chat_template.jinja holds the vision-language one
    for token in VISION_TOKENS:
        settings["added_tokens_decoder"][str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n")


def main() -> None:
    (HERE / "images").mkdir(exist_ok=True)
    for name, (width, height, background, shape, colour) in PICTURES.items():
        # no metadata and fixed compression: the same bytes on every rerun
        draw(width, height, background, shape, colour).save(HERE / "images" / f"{name}.png", optimize=True)
    with open(HERE / "chat.jsonl", "w", encoding="utf-8") as handle:
        for row in chats():
            handle.write(json.dumps(row, sort_keys=True) + "\n")
    model(HERE / "model")


if __name__ == "__main__":
    main()
