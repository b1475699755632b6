"""`packtool stats`: an output's summary (packtool.summaries) as text, and the build summary's lines.

format_headline and heavy_truncation also print under `packtool build`; everything here reads a summary
or a manifest already made and computes nothing from the shards.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from packtool.config import ITEM_FORMATS
from packtool.terminal import shown

# Above this share of a source's kept samples cut to fit, the build summary says so: a pair that lost
# half its prompt is another task, and only `stats` showed it (81 of 300 DPO pairs at capacity 2048).
HEAVY_TRUNCATION = 0.1


def heavy_truncation(manifest: dict[str, Any]) -> list[str]:
    """One line per source more than HEAVY_TRUNCATION of whose kept samples lost tokens to fit a pack
    (a split, which loses none, does not count)."""
    sources = (manifest.get("config") or {}).get("sources") or []
    items = {s.get("name") for s in sources if isinstance(s, dict) and s.get("format") in ITEM_FORMATS}
    lines = []
    for name, counts in (manifest.get("accounting") or {}).items():
        cut = {k: v for k, v in counts.get("truncated", {}).items() if v["tokens"] or v["targets"]}
        samples = sum(v["samples"] for v in cut.values())
        kept = counts.get("kept", 0)
        if kept and samples > HEAVY_TRUNCATION * kept:
            what = "pairs or groups lost prompt tokens" if name in items else "samples lost tokens"
            lines.append(
                f"{samples:,} of {kept:,} {shown(name)} {what} to fit capacity {manifest.get('capacity')} "
                f"({', '.join(f'truncated.{shown(k)}' for k in sorted(cut))})"
            )
    return lines


def format_headline(stats: dict[str, Any]) -> list[str]:
    """The first block of `format_stats`: packs, segments, tokens, efficiency, padding, targets, and the
    target tokens that start in the prompt where there are any (the build summary prints this block)."""
    straddling = sum(a.get("straddling_targets", 0) for a in (stats.get("accounting") or {}).values())
    lines = [
        f"packs              {stats['packs']:>12,}   capacity {stats['capacity']:,}",
        f"segments           {stats['segments']:>12,}   per pack: mean {stats['segments_per_pack']['mean']:.2f}, "
        f"max {stats['segments_per_pack']['max']}",
        f"tokens             {stats['tokens']:>12,}",
        f"token efficiency   {stats['token_efficiency']:>12.4f}   (tokens / (packs x capacity))",
        f"padding if padded  {stats['padding_share_if_padded_to_capacity']:>12.4f}   (share of padding slots)",
        f"targets            {stats['targets']:>12,}   target ratio {stats['target_ratio']:.4f}",
    ]
    if straddling:
        lines.append(
            f"  straddling       {straddling:>12,}   target tokens starting in the prompt, trained (docs/templates.md)"
        )
    return lines


def format_stats(stats: dict[str, Any]) -> str:
    lines = [
        *format_headline(stats),
        "",
        f"{'source':<20} {'segments':>9} {'share':>7} {'tokens':>11} {'share':>7} {'targets':>10} {'share':>7} "
        f"{'repeats':>8}",
    ]
    for name, s in stats["sources"].items():
        lines.append(
            f"{shown(name):<20} {s['segments']:>9,} {s['segment_share']:>7.3f} {s['tokens']:>11,} "
            f"{s['token_share']:>7.3f} "
            f"{s['targets']:>10,} {s['target_share']:>7.3f} {s['repeats']:>8,}"
        )
    if "kinds" in stats:
        kinds = stats["kinds"]
        lines += [
            "",
            f"pairs {kinds['pairs']:,}   groups {kinds['groups']:,}",
            f"{'kind':<20} {'segments':>9} {'tokens':>11} {'targets':>10}",
        ]
        for name, k in kinds["per_kind"].items():
            lines.append(f"{name:<20} {k['segments']:>9,} {k['tokens']:>11,} {k['targets']:>10,}")
    if "images" in stats:
        lines += ["", *format_images(stats["images"])]
    accounting = stats.get("accounting") or {}
    if accounting:
        # notes count samples that were not dropped for them (a literal under `escape`, a straddling token)
        header = f"{'source':<20} {'read':>7} {'kept':>7} {'overflow':>8}  rejected / dropped / truncated | notes"
        lines += ["", header]
        for name, a in accounting.items():
            details = [f"rejected.{shown(k)}={v}" for k, v in a["rejected"].items()]
            details += [f"dropped.{shown(k)}={v}" for k, v in a["dropped"].items()]
            details += [
                f"truncated.{shown(k)}={v['samples']} (-{v['tokens']} tok, -{v['targets']} tgt)"
                for k, v in a.get("truncated", {}).items()
            ]
            notes = [f"{key}={a[key]}" for key in ("special_token_literals", "straddling_targets") if a.get(key)]
            lines.append(
                f"{shown(name):<20} {a['read']:>7,} {a['kept']:>7,} {a['overflow']:>8,}  {', '.join(details) or '-'}"
                + (f" | {', '.join(notes)}" if notes else "")
            )
    mixing = stats.get("mixing") or {}
    if mixing:
        lines += [
            "",
            f"mixing: weights by {shown(mixing.get('by'))}; "
            f"loss normalization: {shown(mixing.get('loss_normalization'))}",
        ]
        for name, quota in (mixing.get("quotas") or {}).items():
            unit = "targets" if quota.get("unit") == "target_tokens" else "tokens"
            realized = (stats.get("sources") or {}).get(name, {}).get(unit, 0)
            amount = f"{quota.get('amount'):,} {shown(quota.get('unit'))}"
            lines.append(f"  quota {shown(name)}: {amount}, realized {realized:,}")
    if "interleave" in stats:
        lines += ["", *format_interleave(stats["interleave"])]
    if "lengths" in stats:
        lines += ["", *format_lengths(stats["lengths"], stats.get("item_sources", []))]
    att = stats["attention"]
    lines += [
        "",
        "attention accounting      padded (1 per row)    packed (block-diag)    flat (one causal row per pack)",
        f"  token slots          {att['token_slots_padded']:>18,} {att['token_slots_packed']:>22,} "
        f"{att['token_slots_packed']:>22,}",
        f"  score slots          {att['score_slots_padded']:>18,} {att['score_slots_packed']:>22,} "
        f"{att['score_slots_flat']:>22,}",
        f"  legal causal pairs   {att['causal_pairs']:>18,} {att['causal_pairs']:>22,} {att['causal_pairs_flat']:>22,}"
        "  (flat counts cross-sample pairs)",
    ]
    return "\n".join(lines)


def format_images(block: dict[str, Any]) -> list[str]:
    """Images and image tokens per pack and per source, with their spread (the `images` block of
    `summaries.summarize`):

    images 120 (15,360 image tokens)
    per pack         mean     min     p50     p90     max      cv
      images         3.75       0       4       6       8   0.512
    """
    lines = [
        f"images {block['images']:,} ({block['image_tokens']:,} image tokens)",
        f"{'':<20} {'mean':>9} {'min':>7} {'p50':>7} {'p90':>7} {'max':>7} {'cv':>7}",
    ]

    def row(name: str, spread: dict[str, Any]) -> str:
        counts = " ".join(f"{spread[key]:>7,}" for key in ("min", "p50", "p90", "max"))
        return f"{name:<20} {spread['mean']:>9,.2f} {counts} {spread['cv']:>7.3f}"

    lines += [row("per pack: images", block["per_pack"]["images"])]
    lines += [row("  image tokens", block["per_pack"]["image_tokens"])]
    for name, source in block["sources"].items():
        lines.append(f"{shown(name)[:20]:<20} {source['images']:,} images, {source['image_tokens']:,} image tokens")
        lines += [row("  per document", source["images_per_document"])]
        lines += [row("  image tokens", source["image_tokens_per_document"])]
    return lines


def format_interleave(block: dict[str, Any]) -> list[str]:
    """Each source's worst window against the mix (the `interleave` block of `summaries.summarize`):

    interleave: windows of 8 packs, shares of tokens within 0.05: worst 0.0312, within (40 windows; 3 packs after)
      source                  share  worst gap  window
      chat                   0.6012     0.0312      17
    """
    verdict = "within" if block["within_tolerance"] else "OUTSIDE the tolerance"
    lines = [
        f"interleave: windows of {block['window']:,} packs, shares of {shown(block['unit'])} within "
        f"{block['tolerance']}: worst {block['worst_deviation']:.4f}, {verdict} ({block['windows']:,} windows; "
        f"{block['partial_window_packs']:,} packs after)",
        f"  {'source':<20} {'share':>7} {'worst gap':>10} {'window':>7}",
    ]
    for name, entry in block["sources"].items():
        lines.append(
            f"  {shown(name):<20} {entry['share']:>7.4f} {entry['worst_deviation']:>10.4f} {entry['worst_window']:>7,}"
        )
    return lines


BAR_WIDTH = 40


def format_lengths(lengths: dict[str, Any] | None, item_sources: Collection[str] = ()) -> list[str]:
    """Per source: length percentiles before/after truncation and a histogram with the capacity marked.

        chat   before  n 120  mean 310.2  p50 288  p90 602  p99 1010  max 1400  over capacity 3
               after   n 120  mean 301.0  p50 288  p90 602  p99 1010  max 1024  over capacity 0
                  [0, 64]  ███████                                      12     12
                  ...
             ──── capacity 1024 ────
               (1024, ∞)  █                                              3      0

    Bars are scaled to the largest "before" count of the source; the two columns are before, after.
    Pair and group sources (`item_sources`) are cut by truncation.items when encoded, before their
    lengths are recorded, so their first row is labelled "as cut", not "before".
    """
    if not lengths:
        return ["lengths: not recorded in this output's manifest (built by an older packtool); rebuild to see them"]
    lines = ["sample lengths in tokens (before / after truncation)"]
    cut = sorted(set(item_sources) & set(lengths))
    if cut:
        lines.append(f'  {", ".join(cut)}: pairs / groups, "as cut" = after truncation.items cut their prompts')
    for name, entry in sorted(lengths.items()):
        before, after = entry["before"], entry["after"]
        first = "as cut" if name in cut else "before"
        for label, summary in ((first, before), ("after", after)):
            lines.append(
                f"{shown(name) if label == first else '':<20} {label:<6} n {summary['count']:,}  "
                f"mean {summary['mean']:.1f}"
                f"  p50 {summary['p50']:,}  p90 {summary['p90']:,}  p99 {summary['p99']:,}  max {summary['max']:,}"
                f"  over capacity {summary['over_capacity']:,}"
            )
        edges = before["histogram"]["edges"]
        counts_before, counts_after = before["histogram"]["counts"], after["histogram"]["counts"]
        top = max(counts_before + counts_after) or 1
        for i, (b, a) in enumerate(zip(counts_before, counts_after)):
            if i == len(edges) - 1:
                lines.append(f"{'':<22}──── capacity {before['capacity']:,} ────")
                span = f"({edges[-1]}, inf)"
            else:
                span = f"{'[' if i == 0 else '('}{edges[i]}, {edges[i + 1]}]"
            bar = "█" * round(BAR_WIDTH * b / top)
            lines.append(f"{'':<22}{span:>14}  {bar:<{BAR_WIDTH}} {b:>8,} {a:>8,}")
    return lines
