"""The config file (``--config.file``): the probe targets ``/probe`` may run.

::

    probe_targets:
      driver-root:
        command: [/run/nvidia/driver/usr/bin/nvidia-smi]
        timeout: 5s
      host:
        command: [chroot, /host, nvidia-smi]

A target's ``command`` is an argv prefix, run without a shell; the probe
appends ``-q -x`` and ``-L``. Names are restricted to ``TARGET_NAME``, so a
name can never be read as a path, an option or shell syntax. Loading checks
the whole file and reports every error at once (``ConfigError.errors``).

The YAML is read by ``_Loader``, for this file and the web config alike: at
most ``MAX_FILE_BYTES``, no anchors or aliases (an alias bomb of a few hundred
bytes would otherwise expand to gigabytes once checked or shown), at most
``MAX_DEPTH`` levels of nesting, no key given twice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import yaml

from mig_exporter.engines.rules import DEFAULT_SETTINGS, EngineSettings, parse_engines

TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
TARGET_NAME_RULE = "a letter or digit, then letters, digits, '_', '.' or '-'; at most 64 characters"
MIN_TIMEOUT_S = 0.1
MAX_TIMEOUT_S = 600.0
_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?")
_DURATION_UNITS_S = (3600.0, 60.0, 1.0, 0.001)
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,79}")
_TOP_LEVEL_KEYS = ("probe_targets", "engines")
_TARGET_KEYS = ("command", "timeout")
# A config is a few KB; a file over this is the wrong file, and is not read further.
MAX_FILE_BYTES = 1 << 20
# No setting goes deeper than a few levels; this stops a file of brackets
# before the composer's recursion does, with a line to point at.
MAX_DEPTH = 32
_SHOWN_ANCHOR_CHARS = 40


class ConfigError(Exception):
    """The config cannot be used; ``errors`` has one line per problem found."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = tuple(errors)
        super().__init__("; ".join(f"{source}: {e}" for e in self.errors))


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """One command ``/probe?target=NAME`` may run. ``timeout_s`` is ``None``
    when the file gives none (``serve --timeout`` applies)."""

    name: str
    command: tuple[str, ...]
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class Config:
    probe_targets: Mapping[str, ProbeTarget]
    source: str = "<config>"
    engines: EngineSettings = DEFAULT_SETTINGS

    def summary(self) -> str:
        """``2 probe targets (driver-root, host); engines: llama.cpp, vllm``, for the log."""
        n = len(self.probe_targets)
        return (f"{n} probe target{'' if n == 1 else 's'} ({', '.join(self.probe_targets) or 'none'}); "
                f"engines: {', '.join(self.engines.engines) or 'none'}")


EMPTY = Config(MappingProxyType({}))


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus-style duration: ``500ms``, ``5s``, ``1m30s``, ``1h``.

    Raises ``ValueError`` for anything else (a bare number is refused: the
    unit must be written).
    """
    m = _DURATION.fullmatch(text) if text else None
    if m is None or not any(m.groups()):
        raise ValueError(f"{text!r} is not a duration (write it like 500ms, 5s or 1m30s)")
    return sum(int(n) * unit for n, unit in zip(m.groups(), _DURATION_UNITS_S, strict=True) if n)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and check the file; raises ``ConfigError`` with every problem."""
    source = str(path)
    try:
        text = _read_file(path)
    except ValueError as e:
        raise ConfigError(source, [str(e)]) from None
    return parse_config(text, source)


def parse_config(text: str | bytes, source: str = "<config>") -> Config:
    """Check a config's text; raises ``ConfigError`` with every problem."""
    try:
        document, duplicates = _parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(source, [_yaml_error(e)]) from None
    errors = duplicates
    targets: dict[str, ProbeTarget] = {}
    if document is None:
        document = {}
    if not isinstance(document, dict):
        errors.append(f"the file must be a mapping with probe_targets and engines, not {_kind(document)}")
    else:
        for key in document:
            if key not in _TOP_LEVEL_KEYS:
                errors.append(f"{_show(key)}: unknown setting (known: {', '.join(_TOP_LEVEL_KEYS)})")
        targets = _probe_targets(document.get("probe_targets"), errors)
        engines, engine_errors = parse_engines(document.get("engines"))
        errors.extend(engine_errors)
    if errors:
        raise ConfigError(source, errors)
    return Config(MappingProxyType(targets), source, engines or DEFAULT_SETTINGS)


def _probe_targets(value: Any, errors: list[str]) -> dict[str, ProbeTarget]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        errors.append(f"probe_targets: must be a mapping of target names to targets, not {_kind(value)}")
        return {}
    targets = {}
    for name, body in value.items():
        where = f"probe_targets.{_show(name)}"
        if not isinstance(name, str):
            errors.append(f"probe_targets.{name!r}: the name is {_kind(name)}; quote it to make it a string")
            continue
        if not TARGET_NAME.fullmatch(name):
            errors.append(f"{where}: not a valid target name ({TARGET_NAME_RULE})")
            continue
        target = _probe_target(name, body, where, errors)
        if target is not None:
            targets[name] = target
    return targets


def _probe_target(name: str, body: Any, where: str, errors: list[str]) -> ProbeTarget | None:
    if not isinstance(body, dict):
        errors.append(f"{where}: must be a mapping with command (and optionally timeout), not {_kind(body)}")
        return None
    found = len(errors)
    for key in body:
        if key not in _TARGET_KEYS:
            errors.append(f"{where}.{_show(key)}: unknown setting (known: {', '.join(_TARGET_KEYS)})")
    command = _command(body.get("command"), f"{where}.command", errors)
    timeout_s = None
    if "timeout" in body:
        timeout_s = _timeout(body["timeout"], f"{where}.timeout", errors)
    if len(errors) > found or command is None:
        return None
    return ProbeTarget(name, command, timeout_s)


def _command(value: Any, where: str, errors: list[str]) -> tuple[str, ...] | None:
    if value is None:
        errors.append(f"{where}: missing; give the argv to run, e.g. [/usr/bin/nvidia-smi]")
        return None
    if isinstance(value, str):
        errors.append(f"{where}: must be a list of arguments (no shell is used), e.g. {[*value.split()]}")
        return None
    if not isinstance(value, list) or not value:
        errors.append(f"{where}: must be a non-empty list of arguments, not {_kind(value)}")
        return None
    before = len(errors)
    for i, arg in enumerate(value):
        if not isinstance(arg, str):
            errors.append(f"{where}[{i}]: {arg!r} is {_kind(arg)}; quote it to make it a string")
        elif not arg:
            errors.append(f"{where}[{i}]: empty argument")
        elif "\0" in arg:
            errors.append(f"{where}[{i}]: contains a NUL character")
    if len(errors) > before:
        return None
    binary = value[0]
    if os.sep in binary and not os.path.isabs(binary):
        errors.append(f"{where}[0]: {binary!r} is a relative path; give an absolute path or a name looked up on PATH")
        return None
    return tuple(value)


def _timeout(value: Any, where: str, errors: list[str]) -> float | None:
    if not isinstance(value, str):
        hint = f" (write {value}s)" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
        errors.append(f"{where}: must be a duration such as 5s or 500ms, not {_kind(value)}{hint}")
        return None
    try:
        seconds = parse_duration(value)
    except ValueError as e:
        errors.append(f"{where}: {e}")
        return None
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        errors.append(f"{where}: {value} is out of range ({MIN_TIMEOUT_S * 1000:.0f}ms to {MAX_TIMEOUT_S / 60:.0f}m)")
        return None
    return seconds


def _read_file(path: str | os.PathLike[str]) -> bytes:
    """A config file's bytes; ``ValueError`` with the one-line reason when it
    cannot be read or is larger than ``MAX_FILE_BYTES``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MiB; a config file is a few KB (is it the right file?)")
    return data


def _parse_yaml(text: str | bytes) -> tuple[Any, list[str]]:
    """The document, and one line per key given twice; raises ``yaml.YAMLError``
    (``_yaml_error`` makes it a line)."""
    if len(text) > MAX_FILE_BYTES:
        raise _Refused(f"larger than {MAX_FILE_BYTES >> 20} MiB; a config file is a few KB", None)
    loader = _Loader(text)
    try:
        return loader.get_single_data(), loader.duplicates
    finally:
        loader.dispose()


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
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in types-PyYAML
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            shown = anchor if len(anchor) <= _SHOWN_ANCHOR_CHARS else anchor[:_SHOWN_ANCHOR_CHARS] + "..."
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise _Refused(f"YAML {kind}{shown}: anchors and aliases are not allowed in this file; "
                           "write the value out in full", event.start_mark)
        if self._depth >= MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep; no setting in this file goes that deep",
                           event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            if key in first_line:
                loader.duplicates.append(
                    f"line {key_node.start_mark.line + 1}: key {_show(key)} is given twice "
                    f"(first on line {first_line[key]})"
                )
            else:
                first_line[key] = key_node.start_mark.line + 1
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


def _one_line(e: BaseException) -> str:
    """An unexpected exception as one bounded line of a log or an answer."""
    text = " ".join(str(e)[:400].split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _kind(value: Any) -> str:
    if value is None:
        return "empty"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def _show(key: Any) -> str:
    """A key as it can be shown on one line of an error message: plain when
    it is a plain word, quoted and escaped otherwise."""
    if isinstance(key, str) and _PLAIN_KEY.fullmatch(key):
        return key
    shown = ascii(key if isinstance(key, str) else repr(key))
    return shown if len(shown) <= 80 else shown[:76] + "...'"
