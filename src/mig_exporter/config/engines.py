"""The ``engines:`` section of the config file: which presets are on, and your own rules.

::

    engines:
      presets:                 # true (the default), false, or preset: true/false
        triton: false
      rules:
        - name: koboldcpp      # the engine label
          exe: koboldcpp       # and comm:, cmdline: (a string or a list of them)
          gpu_offload: {flags: [--gpulayers], when_absent: false}

``parse_engines`` takes the parsed YAML and returns the settings or every error at once;
the rules themselves, the presets and the matching are ``engines.rules``.
"""

from __future__ import annotations

import re

from mig_exporter.config.checks import at, boolean, mapping, must_be, not_a_string, strings, unknown
from mig_exporter.engines.rules import (
    COMM_MAX_LEN,
    DEFAULT_SETTINGS,
    ENGINE_NAME,
    PRESETS,
    EngineRule,
    EngineSettings,
    GpuOffload,
    settings,
)

SECTION_KEYS = ("presets", "rules")
RULE_KEYS = ("name", "comm", "exe", "cmdline", "gpu_offload")
OFFLOAD_KEYS = ("flags", "when_absent")
_SELECTORS = ("comm", "exe", "cmdline")
_ENGINE_NAME_RULE = "letters, digits, '.', '_' or '-', e.g. llama.cpp"


def parse_engines(section: object, where: str = "engines") -> tuple[EngineSettings | None, list[str]]:
    """Validate the ``engines:`` mapping of a config document.

    Returns the settings and no errors, or ``None`` and every error found. A missing section
    (``None``) means every preset and no rules of your own.
    """
    if section is None:
        return DEFAULT_SETTINGS, []
    errors: list[str] = []
    section = mapping(section, where, "a mapping with presets and rules", errors, SECTION_KEYS)
    if section is None:
        return None, errors
    presets = _presets(section.get("presets"), f"{where}.presets", errors)
    rules = _rules(section.get("rules"), f"{where}.rules", errors)
    if errors:
        return None, errors
    return settings(rules, presets), []


def _presets(raw: object, where: str, errors: list[str]) -> list[str]:
    if raw is None or raw is True:
        return list(PRESETS)
    if raw is False:
        return []
    switched = dict.fromkeys(PRESETS, True)
    named = mapping(raw, where, "true, false or a mapping of preset name to true/false", errors)
    if named is None:
        return []
    for name, on in named.items():
        if name not in PRESETS:
            errors.append(unknown(at(where, name), "preset", PRESETS))
        elif (checked := boolean(on, at(where, name), errors)) is not None:
            switched[name] = checked
    return [name for name, on in switched.items() if on]


def _rules(raw: object, where: str, errors: list[str]) -> list[EngineRule]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        errors.append(must_be(where, "a list of rules", raw))
        return []
    rules = (_rule(item, f"{where}[{i}]", errors) for i, item in enumerate(raw))
    return [rule for rule in rules if rule is not None]


def _rule(value: object, where: str, errors: list[str]) -> EngineRule | None:
    before = len(errors)
    raw = mapping({} if value is None else value, where, "a mapping", errors, RULE_KEYS)  # a bare "-": an empty rule
    if raw is None:
        return None
    name = _engine_label(raw.get("name"), f"{where}.name", errors)
    comm, exe, cmdline = (strings(raw.get(key), f"{where}.{key}", errors, lone_string=True, empty_ok=False) or {}
                          for key in _SELECTORS)
    _check_comm_lengths(comm, errors)
    patterns = _patterns(cmdline, errors)
    if not any(key in raw for key in _SELECTORS):
        errors.append(f"{where}: give at least one of comm, exe, cmdline")
    offload = _offload(raw.get("gpu_offload"), f"{where}.gpu_offload", errors)
    if len(errors) > before or name is None:
        return None
    return EngineRule(name, frozenset(comm.values()), frozenset(exe.values()), patterns, offload)


def _engine_label(value: object, where: str, errors: list[str]) -> str | None:
    if value is None:
        errors.append(f"{where}: missing; give the engine label ({_ENGINE_NAME_RULE})")
    elif not isinstance(value, str):
        errors.append(not_a_string(where, value))
    elif not ENGINE_NAME.match(value):
        errors.append(f"{where}: {value!r} is not a valid engine label ({_ENGINE_NAME_RULE})")
    else:
        return value
    return None


def _check_comm_lengths(comm: dict[str, str], errors: list[str]) -> None:
    for path, name in comm.items():
        if len(name.encode()) > COMM_MAX_LEN:
            errors.append(f"{path}: {name!r} is longer than {COMM_MAX_LEN} bytes and can never match: the kernel "
                          f"cuts process names to {COMM_MAX_LEN} "
                          f"({name.encode()[:COMM_MAX_LEN].decode(errors='replace')!r}); "
                          "match it with exe or cmdline instead")


def _patterns(cmdline: dict[str, str], errors: list[str]) -> tuple[re.Pattern[str], ...]:
    patterns = []
    for path, text in cmdline.items():
        try:
            patterns.append(re.compile(text))
        except re.error as e:
            errors.append(f"{path}: {text!r} is not a valid regular expression ({e})")
    return tuple(patterns)


def _offload(value: object, where: str, errors: list[str]) -> GpuOffload | None:
    raw = mapping(value, where, "a mapping with flags and when_absent", errors, OFFLOAD_KEYS)
    if raw is None:
        return None
    flags = strings(raw.get("flags"), f"{where}.flags", errors, lone_string=True, empty_ok=False)
    if raw.get("flags") is None or flags == {}:  # missing or []; anything else wrong has its error
        errors.append(f"{where}.flags: give the flags that take a GPU layer count, e.g. [-ngl, --n-gpu-layers]")
    flags = flags or {}
    errors.extend(f"{path}: {flag!r} is not a command-line flag (it must start with '-')"
                  for path, flag in flags.items() if not flag.startswith("-"))
    when_absent = boolean(raw.get("when_absent", True), f"{where}.when_absent", errors)
    return GpuOffload(tuple(flags.values()), True if when_absent is None else when_absent)
