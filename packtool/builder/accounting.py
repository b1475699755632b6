"""What happened to each record, as one counts type that adds up across work items.

    encode item (one file or row range) --Counts--> cache report JSON (as_report)
    plan: sum of its partitions' Counts (from_report, `+`) per source, then the plan's own
          decisions (kept, overflow, truncated, dropped, segments) --as_dict--> manifest `accounting`

The special-token literal rule is written here once (`note_record`): a record whose content spells a
control token counts once as a literal, whatever its source's policy did with it (kept as text,
escaped, or dropped under `special_token_literal`). `straddling_targets` counts the target tokens of stored
records that start in the prompt (a token holding the header's last character and the target's first, as
`\\n\\n` after Qwen's header when a content opens with a newline): each is trained (packtool.encode).
Counts hold totals only: what the plan needs per record (its straddling targets, a reported overlap, why it was
lost) is in the token store (the stored rows' `straddled` and `reported` columns, the rejects table), summed or
counted within a source's max_samples from there (issue 43).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from packtool.format import CONTAMINATED

SPECIAL_TOKEN_LITERAL = "special_token_literal"  # the drop reason of the `reject` policy
# Valid input a build chose not to train: dropped (counted, in rejects.jsonl), never a failure under on_error: fail.
DROP_KINDS = (SPECIAL_TOKEN_LITERAL, CONTAMINATED)


@dataclass
class Counts:
    """The manifest's `accounting` of one source, or the share of one encode work item in it."""

    read: int = 0
    kept: int = 0
    overflow: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # bad input, by reason
    dropped: Counter[str] = field(default_factory=Counter)  # valid input not trained (too_long, no_targets), by reason
    truncated: dict[str, dict[str, int]] = field(default_factory=dict)  # strategy -> samples/tokens/targets removed
    special_token_literals: int = 0
    straddling_targets: int = 0
    segments: int = 0  # what reached a pack: mixing copies, split pieces and the bucket included
    # samples kept with an overlap with an eval set (decontamination action: report); the dropped ones are
    # dropped[CONTAMINATED]
    contamination_reported: int = 0

    def __add__(self, other: Counts) -> Counts:
        truncated = {k: dict(v) for k, v in self.truncated.items()}
        for strategy, cut in other.truncated.items():
            entry = truncated.setdefault(strategy, {"samples": 0, "tokens": 0, "targets": 0})
            for name, amount in cut.items():
                entry[name] += amount
        return Counts(
            read=self.read + other.read,
            kept=self.kept + other.kept,
            overflow=self.overflow + other.overflow,
            rejected=self.rejected + other.rejected,
            dropped=self.dropped + other.dropped,
            truncated=truncated,
            special_token_literals=self.special_token_literals + other.special_token_literals,
            straddling_targets=self.straddling_targets + other.straddling_targets,
            segments=self.segments + other.segments,
            contamination_reported=self.contamination_reported + other.contamination_reported,
        )

    def note_record(
        self,
        lost: str | None = None,
        *,
        bad_input: bool = False,
        literal: bool = False,
        straddling: int = 0,
    ) -> None:
        """One record read: stored (`lost` None) or lost under its reason, rejected when `bad_input`
        else dropped; `literal`: its content spells a special token; `straddling`: its target tokens that
        start in the prompt (Tokenized.straddled)."""
        self.read += 1
        self.special_token_literals += literal or lost == SPECIAL_TOKEN_LITERAL
        self.straddling_targets += straddling
        if lost is not None:
            (self.rejected if bad_input else self.dropped)[lost] += 1

    def note_truncation(self, strategy: str, tokens: int, targets: int, samples: int = 1) -> None:
        entry = self.truncated.setdefault(strategy, {"samples": 0, "tokens": 0, "targets": 0})
        entry["samples"] += samples
        entry["tokens"] += tokens
        entry["targets"] += targets

    def as_dict(self) -> dict[str, Any]:
        """The manifest's `accounting` entry of a source."""
        return {
            "read": self.read,
            "kept": self.kept,
            "overflow": self.overflow,
            "rejected": dict(sorted(self.rejected.items())),
            "dropped": dict(sorted(self.dropped.items())),
            "truncated": {k: self.truncated[k] for k in sorted(self.truncated)},
            "special_token_literals": self.special_token_literals,
            "straddling_targets": self.straddling_targets,
            "segments": self.segments,
            # only where a sample was reported: an output without decontamination keeps its bytes
            **({"contamination_reported": self.contamination_reported} if self.contamination_reported else {}),
        }

    def as_report(self) -> dict[str, Any]:
        """The counting fields of an encode item's cache report (a pair's or group's cut keeps its
        answers, so its targets: `items_truncated` holds items and tokens)."""
        return {
            "read": self.read,
            "rejected": dict(sorted(self.rejected.items())),
            "dropped": dict(sorted(self.dropped.items())),
            "items_truncated": {
                k: {"items": self.truncated[k]["samples"], "tokens": self.truncated[k]["tokens"]}
                for k in sorted(self.truncated)
            },
            "special_token_literals": self.special_token_literals,
            "straddling_targets": self.straddling_targets,
            **({"contamination_reported": self.contamination_reported} if self.contamination_reported else {}),
        }

    @classmethod
    def from_report(
        cls, report: dict[str, Any], budget: int, stored: Counts, lost: Callable[[int], Iterable[tuple[str, bool]]]
    ) -> Counts:
        """An encode item's counts (its cache report, as_report) limited to its first `budget` records
        (max_samples). `stored`: what its stored records within the budget hold (special-token literals,
        straddling targets, reported overlaps: summed by the plan from the partition's columns);
        `lost(budget)`: the (reason, bad input) of each of its rejects before record `budget`, asked for only
        when the budget cuts the item short.

        Cut short, the item is counted again from those rejects (bad input, which alone carries its error
        `message`, rejected; valid input not trained (a special-token literal, a pair too long) dropped); its
        `items_truncated` is not counted then."""
        if budget >= report["read"]:
            counts = cls(
                read=report["read"],
                rejected=Counter(report["rejected"]),
                dropped=Counter(report["dropped"]),
                special_token_literals=report["special_token_literals"],
            )
            for strategy, cut in report.get("items_truncated", {}).items():
                counts.note_truncation(strategy, cut["tokens"], 0, samples=cut["items"])
        else:
            counts = cls(special_token_literals=stored.special_token_literals)
            for reason, bad_input in lost(budget):
                counts.note_record(reason, bad_input=bad_input)
            counts.read = budget
        counts.contamination_reported = stored.contamination_reported
        counts.straddling_targets = stored.straddling_targets
        return counts
