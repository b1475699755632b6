"""Truncation never cuts an image: every strategy cuts before or after one, an image over capacity is
`image_too_long`, and a pair's prompt cut moves past an image. Token ids are positions, so the ids a
strategy keeps say which tokens survived."""

from __future__ import annotations

import random

import numpy as np
import pytest

from packtool.records import ROLE_CODES, PlacedImage, Tokenized
from packtool.truncate import STRATEGIES, truncate, truncate_item

IMAGE = 9_999  # the image token: no position id reaches it


def with_images(
    messages: list[tuple[str, int, bool]], images: dict[int, list[tuple[int, int]]], example_id: str = "doc"
) -> Tokenized:
    """A chat of `messages` (role, tokens, trained) with one template token before each; `images[m]` lists
    (offset in message m's tokens, image tokens). Ids are positions, image tokens IMAGE."""
    ids: list[int] = []
    index: list[int] = []
    roles: list[int] = []
    targets: list[bool] = []
    placed: list[PlacedImage] = []
    for m, (role, n_tokens, trained) in enumerate(messages):
        ids.append(len(ids))
        index.append(-1)
        roles.append(ROLE_CODES["template"])
        targets.append(False)
        starts = dict(images.get(m, []))
        for t in range(n_tokens):
            if t in starts:
                placed.append(_image(f"img/{m}-{t}.png", len(ids), starts[t]))
                ids += [IMAGE] * starts[t]
                index += [m] * starts[t]
                roles += [ROLE_CODES[role]] * starts[t]
                targets += [False] * starts[t]
            ids.append(len(ids))
            index.append(m)
            roles.append(ROLE_CODES[role])
            targets.append(trained)
    return Tokenized(
        example_id=example_id,
        source="test",
        sample_hash="0" * 64,
        input_ids=np.array(ids, dtype=np.int32),
        targets=np.array(targets, dtype=bool),
        roles=np.array(roles, dtype=np.int8),
        message_index=np.array(index, dtype=np.int16),
        message_roles=tuple(role for role, _, _ in messages),
        images=tuple(placed),
    )


def _image(reference: str, start: int, n_tokens: int) -> PlacedImage:
    return PlacedImage(reference, "a" * 64, 10, 28, 28 * n_tokens, (1, 2, 2 * n_tokens), start, start + n_tokens)


def images_whole(piece: Tokenized) -> None:
    """Each image of the piece spans its tokens exactly, and no image token is outside an image."""
    covered = np.zeros(len(piece), dtype=bool)
    for image in piece.images:
        assert (piece.input_ids[image.start : image.end] == IMAGE).all()
        assert image.end - image.start == image.grid[2] // 2
        covered[image.start : image.end] = True
    assert ((piece.input_ids == IMAGE) == covered).all()


CHAT = [("user", 6, False), ("assistant", 4, True), ("user", 6, False), ("assistant", 4, True)]


def test_right_cuts_before_an_image_it_would_cut():
    sample = with_images(CHAT, {2: [(2, 5)]})  # message 2's image at tokens 15..19
    (kept,) = truncate(sample, 18, "right").samples
    assert len(kept) == 15 and not kept.images  # cut before the image, not inside it at 18


def test_left_starts_after_an_image_it_would_cut():
    sample = with_images(CHAT, {0: [(1, 6)]})  # image at tokens 2..7
    result = truncate(sample, len(sample) - 4, "left")
    (kept,) = result.samples
    assert result.offsets == (8,) and not kept.images
    images_whole(kept)


def test_middle_and_window_keep_images_whole():
    sample = with_images(CHAT, {0: [(1, 6)], 2: [(3, 6)]})
    for strategy in ("middle", "turns"):
        for capacity in range(8, len(sample)):
            for kept in truncate(sample, capacity, strategy).samples:
                assert len(kept) <= capacity
                images_whole(kept)


def test_split_pieces_end_before_an_image_and_keep_every_token():
    text = with_images([("user", 30, True)], {0: [(5, 6), (20, 4)]})
    text = Tokenized(**{**_fields(text), "message_roles": (), "message_index": np.full(len(text), -1, np.int16)})
    result = truncate(text, 10, "split")
    assert np.array_equal(np.concatenate([piece.input_ids for piece in result.samples]), text.input_ids)
    assert [len(piece) for piece in result.samples] == [6, 10, 10, 10, 5]  # the first ends before the image
    for piece, offset in zip(result.samples, result.offsets):
        images_whole(piece)
        for image in piece.images:
            original = next(i for i in text.images if i.reference == image.reference)
            assert original.start == image.start + offset


def _fields(sample: Tokenized) -> dict:
    return {name: getattr(sample, name) for name in Tokenized.__slots__}


def test_an_image_over_capacity_is_image_too_long():
    sample = with_images(CHAT, {2: [(2, 12)]})
    result = truncate(sample, 10, "turns")
    assert result.drop_reason == "image_too_long" and not result.samples
    assert "img/2-2.png" in result.detail and "12 tokens > capacity 10" in result.detail


def test_a_pair_prompt_cut_moves_past_an_image():
    prompt = with_images([("user", 8, False), ("assistant", 3, True)], {0: [(2, 4)]})  # image at 3..6
    kept = truncate_item([prompt, prompt], 2 * (len(prompt) - 4), "left")  # the cut would land at 4, inside
    assert kept.segments and all(segment.input_ids[0] == 7 for segment in kept.segments)
    for segment in kept.segments:
        images_whole(segment)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_random_conversations_never_cut_an_image(strategy):
    rng = random.Random(strategy)
    for trial in range(200):
        messages = [
            (role, rng.randint(1, 12), role == "assistant") for role in ["user", "assistant"] * rng.randint(1, 3)
        ]
        images = {
            m: [(rng.randrange(n), rng.randint(1, 8))] for m, (_, n, _) in enumerate(messages) if rng.random() < 0.5
        }
        sample = with_images(messages, images, f"doc{trial}")
        if strategy in ("window", "split"):  # plain text strategies
            fields = _fields(sample)
            sample = Tokenized(**{**fields, "message_roles": (), "message_index": np.full(len(sample), -1, np.int16)})
        capacity = rng.randint(2, len(sample) + 2)
        result = truncate(sample, capacity, strategy, fallback="right", seed=trial)
        for piece in result.samples:
            assert len(piece) <= capacity
            images_whole(piece)
        if result.drop_reason == "image_too_long":
            assert max(image.end - image.start for image in sample.images) > capacity
