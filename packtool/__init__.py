"""packtool: packed, contamination-free LLM training shards and a loader that keeps them exact.

    import packtool
    config = packtool.load_config("configs/quickstart.yaml", output="out/quickstart")
    built = packtool.build(config)          # Built: manifest, output, what was reused

Both names load on first use, so `import packtool` stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "build", "load_config"]


def __getattr__(name: str) -> Any:
    if name == "build":
        from packtool.builder import build

        return build
    if name == "load_config":
        from packtool.config import load_config

        return load_config
    raise AttributeError(f"module 'packtool' has no attribute {name!r}")
