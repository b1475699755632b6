"""Vision-language inputs: image facts from headers, the processors' grids and token counts, mRoPE positions.

What exists and what does not yet is in docs/vision.md. Pillow is an optional extra
(`pip install "packtool[vision]"`): packtool imports without it, and a vision feature used
without it is one line naming the install.
"""

from __future__ import annotations

from types import ModuleType

from ..errors import PacktoolError

INSTALL = 'pip install "packtool[vision]"'


def pillow() -> ModuleType:
    """PIL.Image, or a one-line error naming the extra that brings it."""
    try:
        from PIL import Image
    except ImportError as error:
        raise PacktoolError(f"images need Pillow, which is not installed: {INSTALL}") from error
    return Image
