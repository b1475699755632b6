"""The PyTorch side: read packed shards, collate padding-free micro-batches, loss, context-parallel slices.

Needs the `loader` extra (torch). Everything here follows docs/format.md ("Loader contract"):
every rank runs the same rounds, shard bytes are verified before use, micro-batches carry
explicit varlen metadata and stay under a hard token budget, the loss is normalised by the
target count of the whole update window, and the data order resumes from a global position.

The front door below is what a training loop needs; the rest stays at its module path
(`packtool.loader.attention`, `.balance`, `.collate`, `.schedule`, `.contract`, `.loss`, `.cp`).
`packtool.loader.hf` (Hugging Face Trainer / TRL integration) is imported on first use;
`packtool.loader.probe` (`packtool audit --probe`, `check_isolation`) only where asked for.
"""

from typing import Any

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in an environment without torch
    raise ImportError(
        "packtool.loader needs PyTorch: pip install 'packtool[loader]' "
        "(on the development machine: pip install torch==2.13.0)"
    ) from err

from packtool.errors import DatasetError
from packtool.loader.attention import varlen_attention
from packtool.loader.collate import LoadedPack, MicroBatch, collate
from packtool.loader.cp import context_parallel_slice
from packtool.loader.dataset import PackedDataset, packed_batches, packed_steps
from packtool.loader.loss import chunked_token_loss_sum, token_loss_sum, window_metrics, window_norm

__all__ = [
    "DatasetError",
    "LoadedPack",
    "MicroBatch",
    "PackedDataset",
    "chunked_token_loss_sum",
    "collate",
    "context_parallel_slice",
    "hf",
    "packed_batches",
    "packed_steps",
    "token_loss_sum",
    "varlen_attention",
    "window_metrics",
    "window_norm",
]


def __getattr__(name: str) -> Any:
    if name == "hf":  # transformers is optional: only its users pay the import
        import importlib

        return importlib.import_module("packtool.loader.hf")
    raise AttributeError(f"module 'packtool.loader' has no attribute {name!r}")
