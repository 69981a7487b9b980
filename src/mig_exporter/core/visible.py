"""Names that came from outside (process names, pod and container labels, a target's answer)
made safe to print on an operator's terminal.

A process can name itself anything: ``\\x1b]0;pwned\\x07`` retitles the terminal, ``\\x1b[2J``
clears it, ``\\r`` or a newline forges a line of the report, ``\\u202e`` (RLO) turns the text
after it around, ``\\u200b`` (a zero-width space) makes two names that differ look the same.
``visible`` writes each character a terminal may obey or draw as nothing as an escape
(``\\x1b``, ``\\u202e``), so what reaches the terminal is the name's characters shown, never
obeyed. ``escaped`` does the same and writes a backslash as ``\\\\`` too, so that a name holding
the text ``\\x1b`` never reads as one holding ESC. ``bounded_name`` cuts a name to a length a
report can hold, with a mark that says how much was cut.

The order is cut first, then escape (``escaped(bounded_name(name))``, which ``shown`` does):
the cut counts the name's own characters, and an escape is never cut in half. ``visible`` leaves
a backslash alone so that it can pass over a whole report line that already holds names
``shown``: what it escapes holds no character it escapes again.

JSON output needs none of this: ``json.dumps`` escapes control characters itself.
"""

from __future__ import annotations

import re

NAME_LIMIT = 256
"""Characters of a name kept in every output, the exposition included."""

# Python's isprintable() already refuses every character of the categories a terminal may obey
# or draw as nothing: controls (Cc: C0, DEL, C1), format characters (Cf: the bidi controls, the
# zero-width spaces and joiners, the word joiner and invisible operators, U+180E, the BOM), line
# and paragraph separators, every space but U+0020, lone surrogates (Cs, which would make a
# terminal's encoder raise), private-use and unassigned code points. These are letters to it,
# yet drawn as nothing: the Hangul fillers.
_BLANK = frozenset("\u115f\u1160\u3164\uffa0")

# A mark bounded_name writes: "…(+N)", N at most 20 digits (no name has 10**20 characters).
_CUT = re.compile(r"…\(\+[1-9][0-9]{0,19}\)")


def _escape(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _hidden(c: str) -> bool:
    return not c.isprintable() or c in _BLANK


def visible(text: str) -> str:
    """``text`` with every control, format, separator (but the space), surrogate, private-use,
    unassigned and blank character written as ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``;
    everything else (letters of any script, emoji, a backslash) unchanged."""
    if text.isprintable() and not any(c in text for c in _BLANK):  # the common case, at C speed
        return text
    return "".join(_escape(c) if _hidden(c) else c for c in text)


def escaped(text: str) -> str:
    """``visible(text)`` with each of the text's own backslashes written ``\\\\``: what is printed
    reads back to one text only. Apply it once to a piece of outside text; ``visible`` may then
    pass over the line that holds it."""
    return visible(text.replace("\\", "\\\\"))


def bounded_name(text: str, limit: int = NAME_LIMIT) -> str:
    """``text`` if it has at most ``limit`` characters, else its first ``limit`` followed by
    ``…(+N)``, N being the characters cut (a 1 MiB name is not a 1 MiB line or label).

    A name already cut at ``limit`` (nothing past it but one mark) is returned as it is: the
    sources cut, and a report that cuts again must not turn ``…(+767)`` into ``…(+7)``. The mark's
    digits are bounded, so a name that forges one is at most a mark longer than the limit."""
    if len(text) <= limit or (len(text) - limit <= 24 and _CUT.fullmatch(text, limit)):
        return text
    return f"{text[:limit]}…(+{len(text) - limit})"


def shown(text: str, limit: int = NAME_LIMIT) -> str:
    """A name as a text report prints it: cut to ``limit``, then escaped."""
    return escaped(bounded_name(text, limit))
