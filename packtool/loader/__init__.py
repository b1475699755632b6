"""The PyTorch side: read packed shards, collate padding-free micro-batches, attention and loss helpers.

Needs the `loader` extra (torch). Everything here follows docs/format.md ("Loader contract" in
DESIGN.md): micro-batches carry explicit varlen metadata, the loss is normalised by the target
count of the whole update window, and the data order resumes from a few integers.

Two reading options of `PackedDataset` (details in dataset.py): `balance="attention"` deals the
packs of every global step to ranks by attention cost (`packed_steps` yields one step's
micro-batches at a time), and `isolate_documents=True` turns the documents of a stream build
into attention segments with no target across them.
"""

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in an environment without torch
    raise ImportError(
        "packtool.loader needs PyTorch: pip install 'packtool[loader]' "
        "(on the development machine: pip install torch==2.13.0)"
    ) from err

from packtool.loader.attention import (
    block_causal_mask,
    document_ids,
    flex_document_mask,
    per_segment_attention,
    select_backend,
    varlen_attention,
)
from packtool.loader.balance import assign_lpt, assign_round_robin, imbalance, pack_costs
from packtool.loader.collate import (
    IGNORE_INDEX,
    MicroBatch,
    PackFormatError,
    PackRow,
    batch_by_tokens,
    collate,
    plan_micro_batches,
    validate_cu_seqlens,
)
from packtool.loader.dataset import BalancedPlan, DatasetError, PackedDataset, packed_batches, packed_steps
from packtool.loader.loss import (
    WindowNorm,
    count_window_targets,
    global_target_count,
    sample_mean_loss,
    token_loss_sum,
    window_norm,
)

__all__ = [
    "IGNORE_INDEX",
    "BalancedPlan",
    "DatasetError",
    "MicroBatch",
    "PackFormatError",
    "PackRow",
    "PackedDataset",
    "WindowNorm",
    "assign_lpt",
    "assign_round_robin",
    "batch_by_tokens",
    "block_causal_mask",
    "collate",
    "count_window_targets",
    "document_ids",
    "flex_document_mask",
    "global_target_count",
    "imbalance",
    "pack_costs",
    "packed_batches",
    "packed_steps",
    "per_segment_attention",
    "plan_micro_batches",
    "sample_mean_loss",
    "select_backend",
    "token_loss_sum",
    "validate_cu_seqlens",
    "varlen_attention",
    "window_norm",
]
