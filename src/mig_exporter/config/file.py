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

A file that looks cut short is refused, so a reload that catches the file half written
keeps the config in force (and ``config_last_reload_successful`` reads 0) instead of
applying "no probe targets": an empty file (or one of comments alone), a section named with
nothing under it (``probe_targets:``), or a last setting with nothing after its colon. A
config with no settings by intent says so: ``{}``, or ``probe_targets: {}``.

The file is read and checked with ``checks`` (one YAML loader, one error shape for
every config file); its ``engines:`` section by ``engines.py``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mig_exporter.config.checks import (
    EMPTY_FILE,
    ConfigError,
    at,
    cut_short,
    duration,
    kind,
    mapping,
    parse_yaml,
    read_file,
    strings,
    top_level,
)
from mig_exporter.config.engines import parse_engines
from mig_exporter.engines.rules import DEFAULT_SETTINGS, EngineSettings

TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
TARGET_NAME_RULE = "a letter or digit, then letters, digits, '_', '.' or '-'; at most 64 characters"
MIN_TIMEOUT_S = 0.1
MAX_TIMEOUT_S = 600.0
_TOP_LEVEL_KEYS = ("probe_targets", "engines")
_TARGET_KEYS = ("command", "timeout")


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


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and check the file; raises ``ConfigError`` with every problem."""
    return parse_config(read_file(path), str(path))


def parse_config(text: str | bytes, source: str = "<config>") -> Config:
    """Check a config's text; raises ``ConfigError`` with every problem."""
    document, errors = parse_yaml(text, source)
    if document is None:
        raise ConfigError(source, [EMPTY_FILE])
    errors.extend(cut_short(document, _TOP_LEVEL_KEYS))
    settings = top_level(document, _TOP_LEVEL_KEYS, errors)
    targets: dict[str, ProbeTarget] = {}
    engines = None
    if settings is not None:
        targets = _probe_targets(settings.get("probe_targets"), errors)
        engines, engine_errors = parse_engines(settings.get("engines"))
        errors.extend(engine_errors)
    if errors:
        raise ConfigError(source, errors)
    return Config(MappingProxyType(targets), source, engines or DEFAULT_SETTINGS)


def _probe_targets(value: Any, errors: list[str]) -> dict[str, ProbeTarget]:
    where = "probe_targets"
    targets: dict[str, ProbeTarget] = {}
    for name, body in (mapping(value, where, "a mapping of target names to targets", errors) or {}).items():
        target_at = at(where, name)
        if not isinstance(name, str):
            errors.append(f"{target_at}: the name is {kind(name)}; quote it to make it a string")
        elif not TARGET_NAME.fullmatch(name):
            errors.append(f"{target_at}: not a valid target name ({TARGET_NAME_RULE})")
        elif (target := _probe_target(name, body, target_at, errors)) is not None:
            targets[name] = target
    return targets


def _probe_target(name: str, value: Any, where: str, errors: list[str]) -> ProbeTarget | None:
    found = len(errors)
    body = mapping({} if value is None else value, where, "a mapping with command (and optionally timeout)", errors,
                   _TARGET_KEYS)  # a name alone is a target without its command
    if body is None:
        return None
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
    if value == []:
        errors.append(f"{where}: must not be empty; give the argv to run, e.g. [/usr/bin/nvidia-smi]")
        return None
    args = strings(value, where, errors, empty_ok=False)
    if args is None:
        return None
    before = len(errors)
    errors.extend(f"{path}: contains a NUL character" for path, arg in args.items() if "\0" in arg)
    if len(errors) > before:
        return None
    binary = value[0]
    if os.sep in binary and not os.path.isabs(binary):
        errors.append(f"{where}[0]: {binary!r} is a relative path; give an absolute path or a name looked up on PATH")
        return None
    return tuple(args.values())


def _timeout(value: Any, where: str, errors: list[str]) -> float | None:
    seconds = duration(value, where, errors)
    if seconds is None:
        return None
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        errors.append(f"{where}: {value} is out of range ({MIN_TIMEOUT_S * 1000:.0f}ms to {MAX_TIMEOUT_S / 60:.0f}m)")
        return None
    return seconds
