"""One checker for every config file the exporter reads: ``--config.file`` (``file.py``, with
its ``engines:`` section in ``engines.py``) and ``--web.config.file`` (``web/webconfig.py``).

Each reader checks the whole file and reports every problem at once, in ``ConfigError.errors``,
one line each, in one of three shapes::

    probe_targets.a.bogus: unknown key (known: command, timeout)      a setting
    line 3, column 14: YAML alias *x: anchors and aliases are ...     the YAML itself
    cannot read: No such file or directory                            the whole file

A setting's path is its keys joined by dots, a list item's index in brackets
(``engines.rules[0].cmdline[1]``), a key that is not a plain word quoted (``show``). Then what is
wrong; then, where it helps, the keys or values that are known, in parentheses. ``str()`` of the
error puts the file's path before each line, as the command line prints them.

The YAML is read by ``_Loader``: at most ``MAX_FILE_BYTES``, no anchors or aliases (an alias bomb
of a few hundred bytes would otherwise expand to gigabytes once checked or shown), at most
``MAX_DEPTH`` levels of nesting, no key given twice.
"""

from __future__ import annotations

import datetime
import os
import re
import stat
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

# A config is a few KB; a file over this is the wrong file, and is not read further.
MAX_FILE_BYTES = 1 << 20
# No setting goes deeper than a few levels; this stops a file of brackets
# before the composer's recursion does, with a line to point at.
MAX_DEPTH = 32
_SHOWN_ANCHOR_CHARS = 40
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,79}")
_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?")
_DURATION_UNITS_S = (3600.0, 60.0, 1.0, 0.001)
_KINDS = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
          datetime.date: "a date", datetime.datetime: "a date", bytes: "binary data", set: "a set"}


class ConfigError(Exception):
    """A config file cannot be used; ``errors`` has one line per problem found."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = tuple(errors)
        super().__init__("; ".join(f"{source}: {e}" for e in self.errors))


# --- the file and its YAML -------------------------------------------------------------------------

def read_file(path: str | os.PathLike[str]) -> bytes:
    """A config file's bytes; ``ConfigError`` with the one-line reason when it cannot be read,
    is not a regular file, or is larger than ``MAX_FILE_BYTES``.

    A FIFO or a device is refused at once, never opened for a blocking read: opening a FIFO
    waits for a writer, and a reload that waits so held a server thread for ever. ``stat``
    first (opening some devices does something), then ``O_NONBLOCK`` and ``fstat`` on what was
    opened, in case the path was swapped between the two."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(str(path), [_not_regular(mode)])
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
        with open(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ConfigError(str(path), [_not_regular(mode)])
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(str(path), [f"cannot read: {e.strerror or e}"]) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(str(path), [
            f"larger than {MAX_FILE_BYTES >> 20} MiB; a config file is a few KB (is it the right file?)"])
    return data


def _not_regular(mode: int) -> str:
    what = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")
    return f"cannot read: {what}, not a regular file (a config file is read whole, once per reload)"


def parse_yaml(text: str | bytes, source: str) -> tuple[Any, list[str]]:
    """The document, and one error per key given twice; ``ConfigError`` when the text is not
    YAML or uses what a config file may not (``_Loader``)."""
    try:
        if len(text) > MAX_FILE_BYTES:
            raise _Refused(f"larger than {MAX_FILE_BYTES >> 20} MiB; a config file is a few KB", None)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None, []
            loader.paths = _paths_of(loader, node)
            return loader.construct_document(node), loader.duplicates
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(source, [_yaml_error(e)]) from None
    except (ValueError, OverflowError) as e:
        # PyYAML's own constructors raise these for a scalar of a right shape and a wrong value
        # (the timestamp 2020-02-30); still a file that cannot be used, not a crash.
        raise ConfigError(source, [f"not valid YAML: {show(str(e), 120)}"]) from None


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML that a config file may not use (``_Loader``)."""

    def __init__(self, problem: str, mark: Any) -> None:  # an event's start_mark, or None
        super().__init__(problem=problem, problem_mark=mark)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors and aliases and deep nesting
    while it composes, before any object is built, and noting keys given
    twice (it would keep the last silently, and a target defined twice is a
    mistake worth reporting)."""

    def __init__(self, stream: str | bytes) -> None:
        super().__init__(stream)
        self.duplicates: list[str] = []
        self.paths: dict[int, str] = {}  # id of each mapping node: its path, for the duplicates
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in types-PyYAML
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            shown = anchor if len(anchor) <= _SHOWN_ANCHOR_CHARS else anchor[:_SHOWN_ANCHOR_CHARS] + "..."
            kind_of = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise _Refused(f"YAML {kind_of}{shown}: anchors and aliases are not allowed in this file; "
                           "write the value out in full", event.start_mark)
        if self._depth >= MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep; no setting in this file goes that deep",
                           event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _paths_of(loader: _Loader, root: yaml.Node) -> dict[int, str]:
    """The path of every mapping node under ``root`` (by ``id``), as the readers write it: a key
    as YAML reads it (``007`` is 7). The composer refused aliases and deep nesting, so this is a
    tree of at most ``MAX_DEPTH`` levels."""
    paths: dict[int, str] = {}
    todo: list[tuple[yaml.Node, str]] = [(root, "")]
    while todo:
        node, where = todo.pop()
        if isinstance(node, yaml.MappingNode):
            paths[id(node)] = where
            # A key that is a mapping or a list is refused when the mapping is built; "?" stands for it.
            todo.extend((value, at(where, loader.construct_object(key) if isinstance(key, yaml.ScalarNode) else "?"))
                        for key, value in node.value)
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((item, f"{where}[{i}]") for i, item in enumerate(node.value))
    return paths


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    first_line: dict[Any, int] = {}
    where = loader.paths.get(id(node), "")
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            if key in first_line:
                loader.duplicates.append(f"{at(where, key)}: given twice (first on line {first_line[key]}, "
                                         f"again on line {line})")
            else:
                first_line[key] = line
        except TypeError:
            pass  # an unhashable key: construct_mapping below reports it
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_error(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    if isinstance(e, _Refused):
        return f"{where}{problem}"
    return f"{where}not valid YAML: {' '.join(str(problem).split())}"


# --- settings --------------------------------------------------------------------------------------

def kind(value: object) -> str:
    """What a YAML value is, as an error names it: ``a mapping``, ``a number``, ``empty``."""
    if value is None:
        return "empty"
    return _KINDS.get(type(value), f"a {type(value).__name__}")


def show(key: object, limit_chars: int = 80) -> str:
    """A key or a value as one line of an error message can hold it: plain when it is a
    plain word, else quoted and escaped, at most ``limit_chars`` long."""
    if isinstance(key, str) and _PLAIN_KEY.fullmatch(key):
        return key
    # Quoted otherwise: the number 5 shows as '5', the string "5" as 5.
    shown = ascii(key if isinstance(key, str) else repr(key))
    return shown if len(shown) <= limit_chars else shown[:limit_chars - 4] + "...'"


def at(where: str, key: object) -> str:
    """The path of ``key`` in the mapping at ``where`` (``""``: the top of the file)."""
    return f"{where}.{show(key)}" if where else show(key)


def must_be(where: str, wanted: str, value: object) -> str:
    """``where: must be WANTED, not KIND``: a setting of the wrong kind."""
    return f"{where}: must be {wanted}, not {kind(value)}"


def unknown(where: str, what: str, known: Iterable[str]) -> str:
    """``where: unknown WHAT (known: a, b)``: a name that is none of those known."""
    return f"{where}: unknown {what} (known: {', '.join(known)})"


def unknown_keys(value: Mapping[Any, Any], where: str, known: Iterable[str], errors: list[str]) -> None:
    """One error for each key of the mapping at ``where`` that is not ``known``."""
    known = tuple(known)
    errors.extend(unknown(at(where, key), "key", known) for key in value if key not in known)


EMPTY_FILE = ("the file is empty (or only comments): refused as probably half written; "
              "a config with no settings by intent is {}")


def cut_short(document: object, sections: Iterable[str]) -> list[str]:
    """Where a file looks cut at a line boundary (a reload that caught it half written): a
    section named with nothing under it, or the file's last setting with nothing after its
    colon. Either parses, into less than the file names; written out by intent, an empty
    section is ``{}`` and a missing one is left out."""
    if not isinstance(document, Mapping):
        return []
    errors = [f"{key}: named with nothing under it: refused as probably cut short; write {key}: {{}} for none"
              for key in sections if key in document and document[key] is None]
    path, node = "", document
    while isinstance(node, Mapping) and node and not errors:
        key, node = list(node.items())[-1]
        path = at(path, key)
        if node is None:
            errors.append(f"{path}: the file ends here with nothing after the colon: refused as probably cut short")
    return errors


def top_level(document: object, known: Iterable[str], errors: list[str]) -> Mapping[Any, Any] | None:
    """The file's settings (an empty file has none), with an error for each key that is not
    ``known``; None, with an error, when the file is not a mapping."""
    known = tuple(known)
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        errors.append(f"the file must be a mapping of settings, not {kind(document)} (known: {', '.join(known)})")
        return None
    unknown_keys(document, "", known, errors)
    return document


def mapping(value: object, where: str, wanted: str, errors: list[str],
            known: Iterable[str] | None = None) -> Mapping[Any, Any] | None:
    """A section or other mapping setting: None when it is missing, or (with an error saying it
    must be ``wanted``) not a mapping; with ``known``, an error for each key that is none of them."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        errors.append(must_be(where, wanted, value))
        return None
    if known is not None:
        unknown_keys(value, where, known, errors)
    return value


def boolean(value: object, where: str, errors: list[str]) -> bool | None:
    """``true`` or ``false``; None, with an error, for anything else."""
    if isinstance(value, bool):
        return value
    errors.append(must_be(where, "true or false", value))
    return None


def string(value: object, where: str, errors: list[str]) -> str | None:
    """An optional string: None when it is missing or empty, or (with an error) not a string."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        errors.append(not_a_string(where, value))
        return None
    return value


def strings(value: object, where: str, errors: list[str], *, lone_string: bool = False,
            empty_ok: bool = True) -> dict[str, str] | None:
    """A list of strings, each by its path (``where[0]``); with ``lone_string``, one string
    stands for a list of one (its path: ``where``). None when it is missing, or (with an
    error per mistake) not such a list."""
    if value is None:
        return None
    if lone_string and isinstance(value, str):
        items = {where: value}
    elif isinstance(value, list):
        items = {f"{where}[{i}]": item for i, item in enumerate(value)}
    else:
        wanted = "a string or a list of strings" if lone_string else "a list of strings"
        errors.append(must_be(where, wanted, value))
        return None
    found = len(errors)
    for path, item in items.items():
        if not isinstance(item, str):
            errors.append(not_a_string(path, item))
        elif not item and not empty_ok:
            errors.append(f"{path}: must not be empty")
    return None if len(errors) > found else items


def not_a_string(where: str, value: object) -> str:
    """The error for a value that should be a string: a number or a boolean YAML read as one
    (``5``, ``yes``) only needs quoting."""
    if isinstance(value, (bool, int, float)):
        return f"{where}: {value!r} is {kind(value)}; quote it to make it a string"
    return must_be(where, "a string", value)


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus-style duration: ``500ms``, ``5s``, ``1m30s``, ``1h``.

    Raises ``ValueError`` for anything else (a bare number is refused: the
    unit must be written).
    """
    m = _DURATION.fullmatch(text) if text else None
    if m is None or not any(m.groups()):
        raise ValueError(f"{text!r} is not a duration (write it like 500ms, 5s or 1m30s)")
    return sum(int(n) * unit for n, unit in zip(m.groups(), _DURATION_UNITS_S, strict=True) if n)


def duration(value: object, where: str, errors: list[str]) -> float | None:
    """Seconds in a duration setting (``parse_duration``); None, with an error, for anything else."""
    if not isinstance(value, str):
        hint = ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            # Only what parse_duration takes: whole seconds, else whole milliseconds.
            hint = f" (write {int(value)}s)" if value == int(value) else f" (write {round(value * 1000)}ms)"
        errors.append(f"{must_be(where, 'a duration such as 5s or 500ms', value)}{hint}")
        return None
    try:
        return parse_duration(value)
    except ValueError as e:
        errors.append(f"{where}: {e}")
        return None


def one_line(e: BaseException) -> str:
    """An unexpected exception (a reload that failed on a bug) as one bounded line of a log or
    an answer."""
    text = " ".join(str(e)[:400].split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
