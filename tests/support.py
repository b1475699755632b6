"""Paths shared by the tests. Real tokenizers and datasets live in ../shared/data (never copied into the repo)."""

from __future__ import annotations

import gc
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from packtool.records import Example

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
QUICKSTART = REPO / "configs" / "quickstart"


def shared(*parts: str) -> Path:
    """A path inside ../shared/data; the test is skipped when the folder is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path


def growth(run: Callable[[int], object], size: int, factor: int = 8, repeats: int = 3) -> float:
    """How much longer run(size * factor) takes than run(size): about `factor` for linear work and
    factor**2 for quadratic. Each is the best of `repeats` runs of this process's CPU time, the two sizes
    taking turns, which leaves out the pauses of a shared machine; absolute times belong in bench/, where
    a loaded machine cannot fail a user's test run. Assert against a bound well between the two (a loaded
    CI machine stretched a linear 4 to 10.6): factor 8 with a bound of 24 tells linear (8) from quadratic
    (64) with room.

    The cyclic garbage collector is off while each run is timed: its full passes walk every object of
    the test process (pytest's included), so their share grows with the run's allocations and a linear
    render measured 15-26 with it on, 8-9 with it off."""
    times: dict[int, list[float]] = {size: [], size * factor: []}
    for _ in range(repeats):
        for n in times:
            gc.collect()
            gc.disable()
            try:
                started = time.process_time()  # this process's CPU time: other processes' load does not count
                run(n)
                times[n].append(time.process_time() - started)
            finally:
                gc.enable()
    return min(times[size * factor]) / min(times[size])


def model_tokenizer(model: str, config_path=None):
    """The tokenizer of a model in ../shared/data/tokenizers (skipped when absent), with its tokenizer_config.json
    or `config_path`."""
    from packtool.config import TokenizerConfig
    from packtool.encode import load_tokenizer

    folder = shared("tokenizers", model)
    return load_tokenizer(
        TokenizerConfig(str(folder / "tokenizer.json"), str(config_path or folder / "tokenizer_config.json"))
    )


def quickstart_model():
    """(tokenizer, its template) of the bundled quickstart model: every test can run it."""
    from packtool.chat_templates import load_template
    from packtool.config import TokenizerConfig
    from packtool.encode import load_tokenizer

    folder = QUICKSTART / "tokenizer"
    tokenizer = load_tokenizer(TokenizerConfig(str(folder / "tokenizer.json"), str(folder / "tokenizer_config.json")))
    return tokenizer, load_template("model", tokenizer.config)


def qwen_model():
    """(tokenizer, its template) of Qwen2.5 from ../shared/data (skipped when absent)."""
    from packtool.chat_templates import load_template

    tokenizer = model_tokenizer("qwen2.5")
    return tokenizer, load_template("model", tokenizer.config)


def images_only_processor(image_processor: Any, tokenizer: Any) -> Any:
    """transformers' Qwen2_5_VLProcessor without its video processor, which needs torchvision: images take the
    same path through it, so it is the reference the vision layout, encode and loader tests hold packtool to.
    (transformers is imported here, not with this module, which every test imports.)"""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnlyProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor: Any, tokenizer: Any) -> None:
            # ProcessorMixin takes its parts from this signature: no video_processor among them
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer)

    return ImagesOnlyProcessor(image_processor, tokenizer)


# The real models' templates the render routes are held to.
PARITY_MODELS = ("qwen2.5", "qwen3", "llama-3.2", "mistral-nemo", "gemma-3", "phi-3-mini")
_TEMPLATES: dict[str, Any] = {}


def model_template(folder: str):
    """The chat template of the tokenizer in `folder`, loaded once per test session."""
    from packtool.chat_templates import load_template
    from packtool.config import TokenizerConfig
    from packtool.encode import load_tokenizer

    if folder not in _TEMPLATES:
        tokenizer = load_tokenizer(TokenizerConfig(f"{folder}/tokenizer.json", f"{folder}/tokenizer_config.json"))
        _TEMPLATES[folder] = load_template("model", tokenizer.config)
    return _TEMPLATES[folder]


def count_renders(template, monkeypatch) -> list[int]:
    """[renders of the template]: jinja2's, and minijinja's single ones (a plain render it takes over)."""
    import packtool.minijinja_engine

    calls = [0]
    render = template.compiled.render
    mini = packtool.minijinja_engine.MiniTemplate.render

    def counting(*args, **kwargs):
        calls[0] += 1
        return render(*args, **kwargs)

    def counting_mini(*args, **kwargs):
        calls[0] += 1
        return mini(*args, **kwargs)

    monkeypatch.setattr(template.compiled, "render", counting)
    monkeypatch.setattr(packtool.minijinja_engine.MiniTemplate, "render", counting_mini)
    return calls


def encode_one(example, tokenizer, template, policy=None, special="escape"):
    """The Tokenized (or RecordError) of one example rendered under `policy` (TrainPolicy() when None)."""
    from packtool.config import TrainPolicy
    from packtool.encode import encode_batch
    from packtool.render import render_chat

    rendered = render_chat(example, template, policy or TrainPolicy(), routed(template))
    (result,) = encode_batch([(rendered, special)], tokenizer)
    return result


def target_text(tokenizer, sample) -> str:
    """The text of a sample's target tokens, special tokens spelled out."""
    return tokenizer.tokenizer.decode(sample.input_ids[sample.targets].tolist(), skip_special_tokens=False)


def chat(*turns: tuple[str, str], **kwargs) -> Example:
    """An Example of these (role, content) turns; `kwargs` set its other fields (tools=...)."""
    from packtool.records import Example, Message

    return Example("ex:0", "src", "hash", messages=tuple(Message(r, c) for r, c in turns), **kwargs)


# A conversation of five turns: a system prompt, two answers, one ending in a code block and a newline.
CONVERSATION = chat(
    ("system", "You are terse."),
    ("user", "Name a prime."),
    ("assistant", "7"),
    ("user", "Another, with a newline at the end please."),
    ("assistant", "11, and here is some code:\n```python\nprint(11)\n```\n"),
)

# A ChatML template of plain jinja: a limit or a refusal under test is put in front of it.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def template_file(folder: Path, text: str, name: str = "t.jinja") -> str:
    """A template file of `text` in `folder`, by its path as a config names it."""
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return str(path)


_ROUTED: dict[int, tuple[object, object]] = {}


def routed(template):
    """The Accelerators every render with this template object shares in a test session, as the encode
    stages hold one per template: a copy (dataclasses.replace) starts with nothing learned."""
    from packtool.render.accelerators import Accelerators

    if id(template) not in _ROUTED:
        _ROUTED[id(template)] = (template, Accelerators())  # the template kept: its id stays its own
    return _ROUTED[id(template)][1]


def learned(template):
    """What the accelerated routes learned of the template so far (routed)."""
    return routed(template).of(template)


def rendered_batch(examples, template, policy: str = "escape") -> list:
    """(Rendered, special-token policy) of every example the template renders; refused ones are left out."""
    from packtool.config import TrainPolicy
    from packtool.errors import RecordError
    from packtool.render import render_chat

    batch = []
    for example in examples:
        try:
            batch.append((render_chat(example, template, TrainPolicy(), routed(template)), policy))
        except RecordError:
            continue
    return batch


def assert_same_samples(first: list, second: list) -> None:
    """Two encodings of one batch: the same tokens, targets, roles and message indices per sample, and
    the same rejections."""
    from packtool.errors import RecordError

    assert len(first) == len(second)
    for a, b in zip(first, second):
        if isinstance(a, RecordError) or isinstance(b, RecordError):
            assert (type(a), str(a)) == (type(b), str(b))
            continue
        for column in ("input_ids", "targets", "roles", "message_index"):
            assert getattr(a, column).tolist() == getattr(b, column).tolist(), (a.example_id, column)


def three_real_sources(quotas: dict[str, dict[str, int]], output: Path) -> dict:
    """The config of a real three-source mix, each source with its quota: code alpaca (down-sampled), a small chat
    set (up-sampled) and c4 split into whole-pack documents, on Qwen2.5 at capacity 1024."""
    sources = [
        {"name": "code", "path": str(shared("datasets", "code_alpaca_2k.json")), "format": "alpaca"},
        {"name": "chat", "path": str(shared("datasets", "fastchat_dummy_conversation.json")), "format": "sharegpt"},
        {
            "name": "web",
            "path": str(shared("datasets", "llamafactory_c4_demo.jsonl")),
            "format": "text",
            "truncation": "split",
        },
    ]
    return {
        "sources": [{**source, "quota": quotas[source["name"]]} for source in sources],
        "tokenizer": str(shared("tokenizers", "qwen2.5")),
        "capacity": 1024,
        "output": str(output),
        "on_error": "skip",
        "truncation": {"strategy": "turns", "fallback": "right"},
    }


def ctrl_c_reaches_child() -> None:
    """`preexec_fn` for a subprocess a test interrupts with SIGINT, as Ctrl-C in a terminal would.

    A shell runs a background job (`.ci/run &`, nohup) with SIGINT ignored and children inherit
    that, so Python would not install its KeyboardInterrupt handler and the signal would be lost;
    the child gets the default back here, before it starts Python.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def claim_rows(shard: Path, rows: int) -> None:
    """Rewrite a Parquet file's footer to claim `rows` rows (its row groups unchanged): the footer's num_rows is
    thrift compact field 3, an i64 right after the schema list (header byte 0x16, a zigzag varint)."""
    import struct

    import pyarrow.parquet as pq

    def varint(n: int) -> bytes:
        out = bytearray()
        while n >= 0x80:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes([*out, n])

    data = shard.read_bytes()
    length = struct.unpack("<i", data[-8:-4])[0]
    footer = data[-8 - length : -8]
    claimed = b"\x16" + varint(2 * pq.ParquetFile(shard).metadata.num_rows)
    if claimed not in footer:
        raise ValueError(f"{shard}: the footer's row count is not where claim_rows looks for it")
    # the first i64 of the footer: the schema before it holds none (row groups after it may repeat the count)
    footer = footer.replace(claimed, b"\x16" + varint(2 * rows), 1)
    shard.write_bytes(data[: -8 - length] + footer + struct.pack("<i", len(footer)) + b"PAR1")


def shard_rows(folder: Path) -> list[dict]:
    """Every pack row of a build folder, shard after shard."""
    import pyarrow.parquet as pq

    from packtool.format import read_manifest

    return [row for s in read_manifest(folder).shards for row in pq.read_table(s.file).to_pylist()]


def chat_rows(n: int, words: int, prefix: str) -> list[dict]:
    """`n` two-turn conversations with ids PREFIX0..; answer i has `words` + i % 7 words."""
    return [
        {
            "id": f"{prefix}{i}",
            "messages": [
                {"role": "user", "content": f"{prefix} question {i}?"},
                {"role": "assistant", "content": " ".join(["answer"] * (words + i % 7))},
            ],
        }
        for i in range(n)
    ]


def two_chat_sources(tmp_path, write_config, write_jsonl, extra_sources=(), **extra):
    """The config of sources a (40 short chats) and b (20 long ones) on the quickstart tokenizer, capacity 256.
    `extra` sets top-level keys, or a source's key as source_I_KEY (source_0_weight=2.5)."""
    from packtool.config import load_config

    write_jsonl(chat_rows(40, 20, "a"), "a.jsonl")
    write_jsonl(chat_rows(20, 60, "b"), "b.jsonl")
    raw = {
        "sources": [
            {"name": "a", "path": "a.jsonl", "format": "messages", "fields": {"id": "id"}},
            {"name": "b", "path": "b.jsonl", "format": "messages", "fields": {"id": "id"}},
        ],
        "tokenizer": str(QUICKSTART / "tokenizer"),
        "capacity": 256,
        "output": "out",
        "rows_per_shard": 7,
    }
    raw["sources"].extend(extra_sources)
    for key, value in extra.items():
        if key.startswith("source_"):
            index, field = key.removeprefix("source_").split("_", 1)
            raw["sources"][int(index)][field] = value
        else:
            raw[key] = value
    return load_config(write_config(raw))
