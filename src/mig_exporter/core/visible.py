"""Names that came from outside (process names, pod and container labels, a target's answer)
made safe to print on an operator's terminal.

A process can name itself anything: ``\\x1b]0;pwned\\x07`` retitles the terminal, ``\\x1b[2J``
clears it, ``\\r`` or a newline forges a line of the report, ``\\u202e`` (RLO) turns the text
after it around. ``visible`` writes each such character as an escape (``\\x1b``, ``\\u202e``),
so what reaches the terminal is the name's bytes shown, never obeyed. ``bounded_name`` cuts a
name to a length a report can hold, with a mark that says how much was cut.

The order is cut first, then escape (``visible(bounded_name(name))``, which ``shown`` does):
the cut counts the name's own characters, and an escape is never cut in half.

JSON output needs none of this: ``json.dumps`` escapes control characters itself.
"""

from __future__ import annotations

import re

NAME_LIMIT = 256
"""Characters of a name kept in every output, the exposition included."""

# Which characters a terminal or a text reader may obey rather than show: C0 controls, DEL and
# C1 controls (0x9b is a one-byte CSI on some terminals, 0x85 a line break), the line and
# paragraph separators, and every bidi control (marks, embeddings, overrides, isolates, the
# Arabic letter mark) plus the BOM / zero-width no-break space.
_HIDDEN = (
    *range(0x00, 0x20), 0x7F, *range(0x80, 0xA0),
    0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F),
    *range(0x2066, 0x206A), 0xFEFF,
)  # fmt: skip
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _HIDDEN}


def visible(text: str) -> str:
    """``text`` with every control, separator and bidi character written as ``\\xNN`` or
    ``\\uNNNN``; everything else (letters of any script, emoji, a backslash) unchanged."""
    return text.translate(_ESCAPES)


def bounded_name(text: str, limit: int = NAME_LIMIT) -> str:
    """``text`` if it has at most ``limit`` characters, else its first ``limit`` followed by
    ``…(+N)``, N being the characters cut (a 1 MiB name is not a 1 MiB line or label).

    A name already cut at ``limit`` is returned as it is: the sources cut, and a report that
    cuts again must not turn ``…(+767)`` into ``…(+7)``."""
    if len(text) <= limit or _CUT.fullmatch(text, limit):
        return text
    return f"{text[:limit]}…(+{len(text) - limit})"


_CUT = re.compile(r"…\(\+[1-9][0-9]*\)")


def shown(text: str, limit: int = NAME_LIMIT) -> str:
    """A name as a text report prints it: cut to ``limit``, then made visible."""
    return visible(bounded_name(text, limit))
