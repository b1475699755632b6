r"""Data printed to a terminal, with every character a terminal would obey or hide shown as an escape.

Sample ids, sources, file names and document text come from files anyone may have written. Printed
raw, ESC [2J clears the screen, CR or a newline overwrites or forges a line, 0x9b is a C1 CSI on
some terminals and U+202E turns `txt.exe` into `exe.txt`. Every command that prints data passes
it through `shown` (text) or `json_shown` (`--json`), also with `--no-color` and into a pipe; the
escapes are Python's, printed as plain characters:

    data                      shown(data)                 printed
    "id" ESC "[2J"            4 characters for ESC        id\x1b[2J
    "a" LF "b"                one line stays one line     a\nb
    "evil" U+202E "txt"                                   evil\u202etxt
    "line 1" LF TAB "line 2"  keep="\n\t": unchanged      (document text keeps its layout)

Escaped: control characters (C0, DEL, C1), format characters (bidi embeddings, overrides and
isolates, zero-width spaces, tags), line and paragraph separators and lone surrogates; kept:
printable text of any script, and the zero-width joiners (ZWJ, ZWNJ) that emoji and several
scripts need, which move nothing.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# Every character but printable ASCII: the few worth a category lookup (a 10 MB ASCII id takes 0.05 s, not 4).
_CANDIDATES = re.compile(r"[^\x20-\x7e]")
_JOINERS = frozenset({"\u200c", "\u200d"})


def hidden(ch: str) -> bool:
    """Whether a terminal would act on this character, or show nothing for it."""
    return unicodedata.category(ch) in _HIDDEN_CATEGORIES and ch not in _JOINERS


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_char(ch: str) -> str:
    """Python's escape for one character: \\n, \\x1b, \\u202e, \\U000e0041."""
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def shown(value: object, keep: str = "") -> str:
    """`str(value)` safe to print: hidden characters escaped, except those in `keep` (e.g. "\\n\\t" for text)."""
    text = str(value)
    if text.isascii() and text.isprintable():  # the common case: ids, names, numbers
        return text

    def escaped(match: re.Match[str]) -> str:
        ch = match.group()
        return escape_char(ch) if ch not in keep and hidden(ch) else ch

    return _CANDIDATES.sub(escaped, text)


def json_shown(value: Any, **dumps: Any) -> str:
    """`json.dumps(value, ensure_ascii=False, ...)`, still valid JSON, with hidden characters as JSON escapes.

    json escapes only C0 controls; DEL, C1 and format characters would reach the terminal raw.
    Outside strings JSON has no such character, so escaping them in the text escapes them in strings.
    """
    text = json.dumps(value, ensure_ascii=False, **dumps)
    if text.isascii() and "\x7f" not in text:
        return text
    return _CANDIDATES.sub(
        lambda m: _json_escape(m.group()) if m.group() != "\n" and hidden(m.group()) else m.group(), text
    )


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    high, low = divmod(code - 0x10000, 0x400)  # JSON spells astral characters as a UTF-16 surrogate pair
    return f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}"
