"""`packtool report`: one offline HTML page whose embedded numbers are `stats --json`'s, rendered in a real
headless browser with the network off."""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from packtool.cli import main

PLOTS = ["plot-lengths", "plot-pack-fill", "plot-segments", "plot-targets", "plot-outcomes"]
CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (Debian: apt-get install chromium; .ci/run installs it)"
)


@pytest.fixture(scope="module")
def outputs(quickstart_build, tmp_path_factory) -> dict[str, Path]:
    """The quickstart output as built (lengths recorded), and a copy whose manifest predates recorded lengths."""
    legacy = tmp_path_factory.mktemp("report") / "out"
    shutil.copytree(quickstart_build, legacy)
    manifest = json.loads((legacy / "manifest.json").read_text())
    assert "lengths" in manifest
    del manifest["lengths"]
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    return {"built": quickstart_build, "legacy": legacy}


def _report(output: Path, destination: Path) -> tuple[str, dict]:
    result = CliRunner().invoke(main, ["report", str(output), "-o", str(destination)])
    assert result.exit_code == 0, result.output
    page = destination.read_text(encoding="utf-8")
    block = re.search(r'<script type="application/json" id="packtool-data">(.*?)</script>', page, re.S)
    assert block is not None
    return page, json.loads(block.group(1))


@pytest.mark.parametrize("kind", ["built", "legacy"])
def test_the_page_embeds_the_numbers_of_stats_json(outputs, tmp_path, kind):
    page, data = _report(outputs[kind], tmp_path / "report.html")
    stats = json.loads(CliRunner().invoke(main, ["stats", str(outputs[kind]), "--json"]).output)
    assert data["capacity"] == stats["capacity"] and data["packs"] == stats["packs"]
    assert data["lengths"] == stats["lengths"]
    assert data["pack_fill"] == stats["pack_fill"]
    assert data["segments_per_pack"] == stats["segments_per_pack"]
    for name, source in stats["sources"].items():
        assert data["segment_lengths"][name] == source["segment_lengths"]
        assert data["target_ratio"][name] == source["target_ratio"]
    for name, a in stats["accounting"].items():
        assert data["outcomes"][name] == {
            "kept": a["kept"],
            "truncated": sum(t["samples"] for t in a["truncated"].values()),
            "rejected": sum(a["rejected"].values()),
            "dropped": sum(a["dropped"].values()),
        }
    # self-contained: nothing is fetched (the SVG namespace is an identifier, not a request)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<link" not in page and "@import" not in page and "fetch(" not in page
    assert len(stats["pack_fill"]["histogram"]["counts"]) == len(stats["pack_fill"]["histogram"]["edges"])


def _tables(dom: str) -> dict[str, list[list[str]]]:
    """Each table of the page by its caption: its rows of cell texts, the header first."""
    tables = {}
    for caption, body in re.findall(r"<table><caption>(.*?)</caption>(.*?)</table>", dom, re.S):
        rows = re.findall(r"<tr>(.*?)</tr>", body, re.S)
        tables[html.unescape(caption)] = [
            [html.unescape(cell) for cell in re.findall(r"<t[hd]>(.*?)</t[hd]>", row, re.S)] for row in rows
        ]
    return tables


@pytest.mark.parametrize("kind", ["built", "legacy"])
def test_without_scripts_the_page_shows_its_numbers_as_tables(outputs, tmp_path, kind):
    page, data = _report(outputs[kind], tmp_path / "report.html")
    noscript = re.search(r"<noscript>(<p .*?)</noscript>", page, re.S)  # the body's, not the head's style
    assert noscript is not None
    tables = _tables(noscript.group(1))
    which = "before truncation" if kind == "built" else "as packed"
    per_source = tables[f"Per source (lengths in tokens, {which})"]
    assert per_source[0][:6] == ["source", "kept", "truncated", "rejected", "dropped", "target ratio"]
    assert len(per_source) == 1 + len(data["outcomes"])
    for row in per_source[1:]:
        outcome = data["outcomes"][row[0]]
        assert [int(v) for v in row[1:5]] == [outcome[k] for k in ("kept", "truncated", "rejected", "dropped")]
        assert float(row[5]) == data["target_ratio"][row[0]]
    fill = tables["Pack fill: packs by length (tokens)"]
    assert [int(n) for _, n in fill[1:]] == data["pack_fill"]["histogram"]["counts"]
    assert sum(int(n) for _, n in tables["Documents per pack"][1:]) == data["packs"]
    assert f"{data['packs']} packs of capacity {data['capacity']}" in noscript.group(1)
    # the JSON block is written into the page (the script filled it), and the plots left empty are hidden
    numbers = re.search(r'<details id="numbers"><summary>The numbers \(JSON\)</summary><pre>(.*?)</pre>', page, re.S)
    assert numbers is not None and json.loads(html.unescape(numbers.group(1))) == data
    assert "<noscript><style>#plots { display: none; }</style></noscript>" in page


@needs_chromium
def test_a_browser_without_scripts_lays_out_the_tables(outputs, tmp_path):
    """Headless Chromium with scripts off prints and dumps nothing, so the page is given to it as a
    browser without scripts reads it: the scripts gone, the <noscript> content shown."""
    page, data = _report(outputs["built"], tmp_path / "report.html")
    static = re.sub(r"<script.*?</script>", "", page, flags=re.S).replace("<noscript>", "").replace("</noscript>", "")
    (tmp_path / "static.html").write_text(static, encoding="utf-8")
    dumped = _chromium(tmp_path / "static.html", tmp_path / "profile", "--dump-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    tables = _tables(dumped.stdout)  # as the browser parsed them
    assert sum(int(n) for _, n in tables["Documents per pack"][1:]) == data["packs"]
    assert len(tables["Per source (lengths in tokens, before truncation)"]) == 1 + len(data["outcomes"])


def test_default_destination_is_inside_the_output(outputs, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(outputs["built"], copy)
    result = CliRunner().invoke(main, ["report", str(copy)])
    assert result.exit_code == 0 and (copy / "report.html").is_file()


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit non-interlaced RGB/RGBA PNG; enough to judge a screenshot."""
    blob = path.read_bytes()
    if blob[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    offset, idat, header = 8, b"", None
    while offset < len(blob):
        (length,) = struct.unpack(">I", blob[offset : offset + 4])
        kind, body = blob[offset + 4 : offset + 8], blob[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    width, height, depth, color, _, _, interlace = header
    if depth != 8 or color not in (2, 6) or interlace:
        raise ValueError(f"{path}: unsupported PNG (depth {depth}, colour type {color}, interlace {interlace})")
    channels = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):  # undo the per-row filter (PNG spec, section 9)
            a = line[i - channels] if i >= channels else 0
            b, c = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        previous = line
    return width, height, rows


def _chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        # the network is off: every request would go to a closed local port
        "--proxy-server=127.0.0.1:9",
        "--proxy-bypass-list=<-loopback>",
    ]
    return subprocess.run(
        [CHROMIUM, *flags, *extra, page.as_uri()], capture_output=True, text=True, timeout=120, check=False
    )


@needs_chromium
@pytest.mark.parametrize("kind", ["built", "legacy"])
def test_every_plot_renders_in_headless_chromium(outputs, tmp_path, kind):
    page = tmp_path / "report.html"
    _report(outputs[kind], page)
    dumped = _chromium(page, tmp_path / "profile", "--dump-dom")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = dumped.stdout
    assert 'data-rendered="true"' in dom  # the script ran to its end
    for plot in PLOTS:
        figure = re.search(rf'<figure class="plot" id="{plot}">(.*?)</figure>', dom, re.S)
        assert figure is not None, plot
        assert "<svg" in figure.group(1) and '<rect class="mark' in figure.group(1), f"{plot} has no marks"
    lengths = re.search(r'<figure class="plot" id="plot-lengths">(.*?)</figure>', dom, re.S).group(1)
    assert lengths.count("<svg") == 3 and lengths.count('class="capacity"') == 3  # one per source, capacity marked
    assert ('class="mark after' in lengths) == (kind == "built")
    console = [line for line in dumped.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert console == [], console  # the page logs nothing when it renders cleanly

    shot = tmp_path / "shot.png"
    taken = _chromium(page, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1000,1400")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    width, height, rows = png_pixels(shot)
    assert (width, height) == (1000, 1400)
    colours = {row[i : i + 3] for row in rows[::4] for i in range(0, len(row), 12)}
    background = rows[0][:3]
    inked = sum(row[i : i + 3] != background for row in rows[::4] for i in range(0, len(row), 12))
    assert len(colours) > 8 and inked > 0.02 * (len(rows) // 4) * (len(rows[0]) // 12), (len(colours), inked)


# Runs after the page's own script: the box of every SVG text element, as the browser laid it out, and
# each bar with its count, written into the DOM for --dump-dom to carry out.
MEASURE = """<script>
(function () {
  var boxes = Array.prototype.map.call(document.querySelectorAll("svg text"), function (t) {
    var r = t.getBoundingClientRect();
    return {text: t.textContent, left: r.left, right: r.right, top: r.top, bottom: r.bottom};
  });
  var bars = Array.prototype.map.call(document.querySelectorAll("#plot-outcomes rect"), function (r) {
    return {title: r.querySelector("title").textContent, height: r.getBoundingClientRect().height};
  });
  var out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify({boxes: boxes, bars: bars});
  document.body.appendChild(out);
})();
</script>"""


def _overlapping(boxes: list[dict], gap: float = 2) -> list[tuple[str, str]]:
    """Pairs of text boxes on common lines less than `gap` pixels apart side by side (labels that read as one)."""
    pairs = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            beside = a["left"] < b["right"] + gap and b["left"] < a["right"] + gap
            if beside and a["top"] < b["bottom"] and b["top"] < a["bottom"]:
                pairs.append((a["text"], b["text"]))
    return pairs


def test_overlap_detection():
    box = {"text": "a", "left": 0, "right": 10, "top": 0, "bottom": 10}
    assert _overlapping([box, {**box, "text": "b", "left": 9, "right": 20}]) == [("a", "b")]
    assert _overlapping([box, {**box, "text": "b", "left": 11, "right": 20}]) == [("a", "b")]  # 1 px apart
    assert _overlapping([box, {**box, "text": "b", "left": 12, "right": 20}]) == []
    assert _overlapping([box, {**box, "text": "b", "top": 10, "bottom": 20}]) == []


@needs_chromium
def test_no_text_overlaps_and_small_counts_stay_visible(outputs, tmp_path):
    """Before: tick labels ran into each other (24 and 26 documents per pack), a count of 1 rejected record beside
    1,300 kept was a bar under a pixel, and the footer named a JSON block the page did not show."""
    copy = tmp_path / "out"
    shutil.copytree(outputs["built"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["accounting"]["chat"]["rejected"] = {"invalid_role": 1}
    manifest["accounting"]["docs"]["dropped"] = {"no_targets": 2}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    page = tmp_path / "report.html"
    _report(copy, page)
    page.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "\n</body>"), encoding="utf-8")
    dumped = _chromium(page, tmp_path / "profile", "--dump-dom", "--window-size=1000,1400")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    measured = json.loads(html.unescape(re.search(r'<pre id="measured">(.*?)</pre>', dumped.stdout, re.S).group(1)))
    boxes = [b for b in measured["boxes"] if b["right"] > b["left"]]
    assert len(boxes) > 40
    assert _overlapping(boxes) == []
    bars = {bar["title"]: bar["height"] for bar in measured["bars"]}
    assert bars["chat: 1 (rejected)"] >= 3 and bars["docs: 2 (dropped)"] >= 3
    assert bars["chat: 0 (dropped)"] == 0
    values = [b["text"] for b in boxes]
    assert "1" in values and "2" in values and "1,300" in values  # each outcome bar prints its count
    numbers = re.search(
        r'<details id="numbers"><summary>The numbers \(JSON\)</summary><pre>(.*?)</pre>', dumped.stdout, re.S
    )
    assert numbers is not None and json.loads(html.unescape(numbers.group(1)))["packs"] == manifest["stats"]["packs"]
