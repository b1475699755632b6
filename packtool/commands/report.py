"""`packtool report`: one self-contained HTML page of an output's statistics, readable offline.

The page carries its numbers as JSON in `<script type="application/json" id="packtool-data">`
and draws every plot from them with a small inline script (SVG, no library, no network). A browser
that runs no script (a mail client, a locked-down viewer) shows the same numbers as static tables
in `<noscript>`: the summary, per source, pack fill and documents per pack; the empty plots are hidden
there, and the JSON block at the foot is written into the page, not by the script. The plots:

    lengths       per source: a histogram of sample lengths with the capacity marked; before and after
                  truncation when the build recorded them (manifest `lengths`), else the packed documents
    pack_fill     packs by length, in sixteenths of capacity
    segments      packs by number of documents
    targets       target ratio (targets / tokens) per source
    outcomes      per source: records kept, truncated, rejected and dropped, each bar with its count

A non-zero bar is at least 3 pixels tall (one rejected record beside a thousand kept would be
under a pixel), tick labels that would overlap are left out, and the JSON is also shown, folded,
at the end of the page.

Every number comes from `packtool stats --json` (`summarize`), so the page and the command agree.
"""

from __future__ import annotations

import html
import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import packtool


def report_data(stats: dict[str, Any]) -> dict[str, Any]:
    """The numbers the page plots, each a value of `stats` (named by its path there)."""
    accounting = stats.get("accounting") or {}
    outcomes = {}
    for name, a in accounting.items():
        truncated = sum(entry["samples"] for entry in a["truncated"].values())
        outcomes[name] = {
            "kept": a["kept"],
            "truncated": truncated,
            "rejected": sum(a["rejected"].values()),
            "dropped": sum(a["dropped"].values()),
        }
    return {
        "capacity": stats["capacity"],
        "packs": stats["packs"],
        "token_efficiency": stats["token_efficiency"],
        "lengths": stats.get("lengths"),
        "segment_lengths": {name: s["segment_lengths"] for name, s in stats["sources"].items()},
        "pack_fill": stats["pack_fill"],
        "segments_per_pack": stats["segments_per_pack"],
        "target_ratio": {name: s["target_ratio"] for name, s in stats["sources"].items()},
        "outcomes": outcomes,
    }


def render_report(stats: dict[str, Any], *, title: str) -> str:
    numbers = report_data(stats)
    data = json.dumps(numbers, sort_keys=True)
    # "</" would end the script element early; JSON allows the escaped slash.
    data = data.replace("</", "<\\/")
    return _PAGE.format(
        title=html.escape(title),
        version=html.escape(packtool.__version__),
        data=data,
        numbers=html.escape(json.dumps(numbers, sort_keys=True, indent=1)),
        tables=static_tables(numbers),
        style=_STYLE,
        script=_SCRIPT,
    )


def static_tables(data: dict[str, Any]) -> str:
    """The plotted numbers as HTML tables, for a page read with scripts off."""

    def table(caption: str, header: list[str], rows: list[list[Any]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
        return f"<table><caption>{html.escape(caption)}</caption><tr>{head}</tr>{body}</table>"

    def bins(summary: dict[str, Any]) -> list[str]:
        edges = summary["histogram"]["edges"]
        return [f"{low + 1 if k else 0}-{high}" for k, (low, high) in enumerate(pairwise(edges))] + [f">{edges[-1]}"]

    recorded = data.get("lengths")
    names = sorted(recorded or data["segment_lengths"])
    per_source = []
    for name in names:
        lengths = recorded[name]["before"] if recorded else data["segment_lengths"][name]
        outcome = data["outcomes"].get(name, {})
        per_source.append(
            [
                name,
                *(outcome.get(kind, 0) for kind in ("kept", "truncated", "rejected", "dropped")),
                data["target_ratio"].get(name, ""),
                *(lengths[key] for key in ("p50", "p90", "p99", "max", "over_capacity")),
            ]
        )
    which = "before truncation" if recorded else "as packed"
    fill = data["pack_fill"]
    parts = [
        f"<p>{data['packs']} packs of capacity {data['capacity']}, token efficiency {data['token_efficiency']}</p>",
        table(
            f"Per source (lengths in tokens, {which})",
            [
                "source",
                "kept",
                "truncated",
                "rejected",
                "dropped",
                "target ratio",
                "p50",
                "p90",
                "p99",
                "max",
                "over capacity",
            ],
            per_source,
        ),
    ]
    if fill:
        counts = fill["histogram"]["counts"]
        parts.append(
            table(
                "Pack fill: packs by length (tokens)",
                ["length", "packs"],
                [[label, n] for label, n in zip(bins(fill), counts)],
            )
        )
    per_pack = data["segments_per_pack"]["histogram"]
    parts.append(table("Documents per pack", ["documents", "packs"], [[k, n] for k, n in enumerate(per_pack) if n]))
    return "\n".join(parts)


def write_report(output: str | Path, destination: str | Path | None = None) -> Path:
    """Write the report of an output folder (default: OUTPUT/report.html) and return its path."""
    from packtool.shards import locate
    from packtool.summaries import summarize

    folder, manifest, files = locate(output)
    stats = summarize(files, manifest)
    path = Path(destination) if destination is not None else folder / "report.html"
    path.write_text(render_report(stats, title=f"packtool report: {folder.name}"), encoding="utf-8")
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>{style}</style>
<noscript><style>#plots {{ display: none; }}</style></noscript>
</head>
<body>
<h1>{title}</h1>
<p class="summary" id="summary"></p>
<noscript><p class="note">Scripts are off: the plots are not drawn, their numbers follow.</p>
{tables}
</noscript>
<section id="plots">
<figure class="plot" id="plot-lengths"><figcaption>Sample lengths per source (tokens), capacity marked</figcaption>
<div class="multiples"></div></figure>
<figure class="plot" id="plot-pack-fill"><figcaption>Pack fill: packs by length</figcaption><svg></svg></figure>
<figure class="plot" id="plot-segments"><figcaption>Documents per pack</figcaption><svg></svg></figure>
<figure class="plot" id="plot-targets"><figcaption>Target ratio per source (targets / tokens)</figcaption><svg></svg>
</figure>
<figure class="plot" id="plot-outcomes"><figcaption>Records per source: kept, truncated, rejected, dropped</figcaption>
<svg></svg></figure>
</section>
<footer>packtool {version}; every number on this page is in the JSON below, taken from
<code>packtool stats --json</code>.
<details id="numbers"><summary>The numbers (JSON)</summary><pre>{numbers}</pre></details></footer>
<script type="application/json" id="packtool-data">{data}</script>
<script>{script}</script>
</body>
</html>
"""

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; }
figure.plot { margin: 0 0 28px; }
figcaption { font-weight: 600; margin-bottom: 6px; }
.multiples { display: flex; flex-wrap: wrap; gap: 16px; }
.multiples div { font-size: 12px; }
svg { display: block; }
svg text { font-size: 10px; fill: #444; }
.mark { fill: #3b6fb6; }
.mark.after { fill: #e08a2c; }
.mark.truncated { fill: #e0b12c; }
.mark.rejected { fill: #c0392b; }
.mark.dropped { fill: #7f8c8d; }
.capacity { stroke: #c0392b; stroke-width: 1.5; stroke-dasharray: 4 2; }
.capacity-label { paint-order: stroke; stroke: #fff; stroke-width: 3px; }  /* legible over a full bar */
.legend { font-size: 12px; }
details pre { font-size: 11px; max-height: 400px; overflow: auto; background: #f6f6f6; padding: 8px; }
.note { color: #a33; }
table { border-collapse: collapse; margin: 0 0 20px; }
caption { font-weight: 600; text-align: left; margin-bottom: 4px; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
"""

# Plain DOM and SVG, no library: the page must open with no network.
_SCRIPT = r"""
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var data = JSON.parse(document.getElementById("packtool-data").textContent);
  var MIN_BAR = 3;  // pixels

  function el(parent, name, attrs, text) {
    var node = document.createElementNS(NS, name);
    for (var key in attrs) node.setAttribute(key, attrs[key]);
    if (text !== undefined) node.textContent = text;
    parent.appendChild(node);
    return node;
  }

  // Vertical bars. series: [{values, cls}] drawn side by side per category; marker: index of a
  // category boundary to draw the capacity line before; values: print each bar's count above it.
  function bars(svg, labels, series, opts) {
    var width = opts.width || 560, height = opts.height || 180, left = 44, bottom = 34;
    var head = opts.values ? 20 : 8;  // room above the tallest bar for its count
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    var top = 1;
    series.forEach(function (s) { s.values.forEach(function (v) { top = Math.max(top, v); }); });
    var plotW = width - left - 8, plotH = height - bottom - head, step = plotW / labels.length;
    var barW = Math.max(1, (step - 2) / series.length), base = head + plotH;
    el(svg, "line", {x1: left, y1: base, x2: left + plotW, y2: base, stroke: "#999"});
    el(svg, "text", {x: left - 4, y: head + 4, "text-anchor": "end"}, String(top));
    el(svg, "text", {x: left - 4, y: base, "text-anchor": "end"}, "0");
    series.forEach(function (s, j) {
      s.values.forEach(function (v, i) {
        // A count of 1 among thousands would be under a pixel: every non-zero bar is at least MIN_BAR tall.
        var h = v > 0 ? Math.max(plotH * v / top, MIN_BAR) : 0, x = left + i * step + 1 + j * barW;
        var rect = el(svg, "rect", {"class": "mark " + (s.cls || ""), x: x, y: base - h, width: barW, height: h});
        el(rect, "title", {}, labels[i] + ": " + v + (s.name ? " (" + s.name + ")" : ""));
        if (opts.values) {
          el(svg, "text", {"class": "value", x: x + barW / 2, y: base - h - 3, "text-anchor": "middle"},
             v.toLocaleString("en-US"));
        }
      });
    });
    var every = Math.ceil(labels.length / (opts.ticks || 8)), ticks = [];
    labels.forEach(function (label, i) {
      if (i % every === 0 || i === labels.length - 1) {
        ticks.push(el(svg, "text", {"class": "tick", x: left + i * step + step / 2, y: height - 18,
                                    "text-anchor": "middle"}, label));
      }
    });
    dropOverlapping(ticks);
    if (opts.marker !== undefined) {
      var x = left + opts.marker * step;
      el(svg, "line", {"class": "capacity", x1: x, y1: 4, x2: x, y2: base});
      el(svg, "text", {"class": "capacity-label", x: x - 3, y: 10, "text-anchor": "end"}, "capacity " + data.capacity);
    }
    if (opts.xlabel) el(svg, "text", {x: left + plotW / 2, y: height - 4, "text-anchor": "middle"}, opts.xlabel);
  }

  // Tick labels left to right: one that would touch the last kept label is removed, except the last
  // tick (the open-ended bin), which removes its neighbour instead.
  function dropOverlapping(ticks) {
    var kept = [];
    ticks.forEach(function (tick, i) {
      var previous = kept[kept.length - 1];
      if (previous && previous.getBBox().x + previous.getBBox().width + 4 > tick.getBBox().x) {
        if (i < ticks.length - 1 || kept.length === 1) { tick.remove(); return; }
        previous.remove();
        kept.pop();
      }
      kept.push(tick);
    });
  }

  function histogramLabels(summary) {
    var edges = summary.histogram.edges, labels = [];
    for (var i = 1; i < edges.length; i++) labels.push(String(edges[i]));
    labels.push(">" + edges[edges.length - 1]);
    return labels;
  }

  function lengths() {
    var box = document.querySelector("#plot-lengths .multiples");
    var recorded = data.lengths;
    var names = Object.keys(recorded || data.segment_lengths).sort();
    if (!recorded) {
      var note = document.createElement("p");
      note.className = "note";
      note.textContent = "This build did not record lengths before truncation; showing packed documents.";
      box.parentNode.insertBefore(note, box);
    }
    names.forEach(function (name) {
      var cell = document.createElement("div");
      var series, summary;
      if (recorded) {
        summary = recorded[name].before;
        series = [{values: summary.histogram.counts, name: "before"},
                  {values: recorded[name].after.histogram.counts, cls: "after", name: "after"}];
      } else {
        summary = data.segment_lengths[name];
        series = [{values: summary.histogram.counts, name: "packed"}];
      }
      cell.textContent = name + ": p50 " + summary.p50 + ", p90 " + summary.p90 + ", p99 " + summary.p99 +
        ", max " + summary.max + ", over capacity " + summary.over_capacity +
        (recorded ? " (before truncation; blue before, orange after)" : "");
      var svg = document.createElementNS(NS, "svg");
      cell.appendChild(svg);
      box.appendChild(cell);
      bars(svg, histogramLabels(summary), series,
           {width: 420, height: 170, marker: summary.histogram.counts.length - 1, ticks: 5, xlabel: "tokens"});
    });
  }

  function simple(id, labels, values, opts) {
    bars(document.querySelector(id + " svg"), labels, [{values: values}], opts);
  }

  function outcomes() {
    var names = Object.keys(data.outcomes).sort();
    var kinds = ["kept", "truncated", "rejected", "dropped"];
    var series = kinds.map(function (kind) {
      return {values: names.map(function (n) { return data.outcomes[n][kind]; }), cls: kind, name: kind};
    });
    bars(document.querySelector("#plot-outcomes svg"), names, series, {width: 560, height: 220, values: true});
    var legend = document.createElement("p");
    legend.className = "legend";
    legend.textContent = "bars per source, left to right: " + kinds.join(", ");
    document.getElementById("plot-outcomes").appendChild(legend);
  }

  document.getElementById("summary").textContent = data.packs + " packs of capacity " + data.capacity +
    ", token efficiency " + data.token_efficiency;
  lengths();
  simple("#plot-pack-fill", histogramLabels(data.pack_fill), data.pack_fill.histogram.counts,
         {marker: data.pack_fill.histogram.counts.length - 1, xlabel: "tokens in the pack"});
  var perPack = data.segments_per_pack.histogram;
  simple("#plot-segments", perPack.map(function (_, k) { return String(k); }), perPack, {xlabel: "documents"});
  var sources = Object.keys(data.target_ratio).sort();
  simple("#plot-targets", sources, sources.map(function (n) { return data.target_ratio[n]; }), {height: 160});
  outcomes();
  document.body.setAttribute("data-rendered", "true");
})();
"""
