"""The config file: what it accepts, and every error reported at once, one line each."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mig_exporter.config.checks import ConfigError, parse_duration
from mig_exporter.config.file import ProbeTarget, load_config, parse_config


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "mig.yml")
    assert all("\n" not in e for e in raised.value.errors)
    return list(raised.value.errors)


@pytest.mark.parametrize("text, seconds", [
    ("5s", 5.0), ("500ms", 0.5), ("1m", 60.0), ("1m30s", 90.0), ("2m5s250ms", 125.25), ("1h", 3600.0),
    ("10ms", 0.01), ("0s", 0.0),
])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "1.5s", "5x", "s", "5 s", "-5s", "5S", "30s1m", "1d", "ms", " 5s"])
def test_not_durations(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


def test_a_config_with_targets() -> None:
    config = parse_config(
        "probe_targets:\n"
        "  driver-root:\n"
        "    command: [/run/nvidia/driver/usr/bin/nvidia-smi]\n"
        "    timeout: 5s\n"
        "  host:\n"
        "    command: [chroot, /host, nvidia-smi]\n"
        "  gpu-07.lab_2:\n"
        "    command: ['ssh', 'gpu-07', 'nvidia-smi']\n"
        "    timeout: 1m\n",
        "mig.yml",
    )
    assert dict(config.probe_targets) == {
        "driver-root": ProbeTarget("driver-root", ("/run/nvidia/driver/usr/bin/nvidia-smi",), 5.0),
        "host": ProbeTarget("host", ("chroot", "/host", "nvidia-smi"), None),
        "gpu-07.lab_2": ProbeTarget("gpu-07.lab_2", ("ssh", "gpu-07", "nvidia-smi"), 60.0),
    }
    assert config.source == "mig.yml"
    with pytest.raises(TypeError):
        config.probe_targets["new"] = config.probe_targets["host"]  # type: ignore[index]


@pytest.mark.parametrize("text", ["{}\n", "# no probe targets on this node\n{}\n", "probe_targets: {}\n",
                                  "engines: {}\n"])
def test_a_config_without_targets_by_intent_is_valid(text: str) -> None:
    assert dict(parse_config(text).probe_targets) == {}


EMPTY_FILE = ("the file is empty (or only comments): refused as probably half written; "
              "a config with no settings by intent is {}")
FULL = ("probe_targets:\n"
        "  driver-root:\n"
        "    command: [/run/nvidia/driver/usr/bin/nvidia-smi]\n"
        "    timeout: 5s\n"
        "engines:\n"
        "  presets:\n"
        "    vllm: false\n")


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing yet\n"])
def test_an_empty_config_is_refused_as_probably_half_written(text: str) -> None:
    # Applied, it was "0 probe targets": every probe answered 400 (issue 38).
    assert errors_of(text) == [EMPTY_FILE]


@pytest.mark.parametrize("lines, error", [
    (1, "probe_targets: named with nothing under it: refused as probably cut short; write probe_targets: {} for none"),
    (5, "engines: named with nothing under it: refused as probably cut short; write engines: {} for none"),
    (6, "engines.presets: the file ends here with nothing after the colon: refused as probably cut short"),
])
def test_a_config_cut_at_a_line_boundary_is_refused(lines: int, error: str) -> None:
    # Each of these is valid YAML that names more than it holds: the file as a writer left it
    # half way, not a config anyone meant.
    assert error in errors_of("".join(FULL.splitlines(keepends=True)[:lines]))


def test_the_whole_file_is_still_accepted() -> None:
    config = parse_config(FULL)
    assert list(config.probe_targets) == ["driver-root"]
    assert "vllm" not in config.engines.engines


def test_every_error_is_reported_at_once() -> None:
    errors = errors_of(
        "probe_targets:\n"
        "  good:\n"
        "    command: [/usr/bin/nvidia-smi]\n"
        "  shell:\n"
        "    command: ssh gpu-07 nvidia-smi\n"
        "  number:\n"
        "    command: [timeout, 5, nvidia-smi]\n"
        "    timeout: 5\n"
        "  relative:\n"
        "    command: [./nvidia-smi]\n"
        "    timeout: 20m\n"
        "  typo:\n"
        "    comand: [nvidia-smi]\n"
        "  empty:\n"
        "    command: []\n"
        "    timeout: fast\n"
        "  '../etc':\n"
        "    command: [nvidia-smi]\n"
        "  not-a-mapping: [nvidia-smi]\n"
        "  blank-arg:\n"
        "    command: [nvidia-smi, '']\n"
        "  good:\n"
        "    command: [/usr/bin/nvidia-smi]\n"
        "scrape_interval: 15s\n"
    )
    assert errors == [
        "probe_targets.good: given twice (first on line 2, again on line 22)",
        "scrape_interval: unknown key (known: probe_targets, engines)",
        "probe_targets.shell.command: must be a list of arguments (no shell is used), "
        "e.g. ['ssh', 'gpu-07', 'nvidia-smi']",
        "probe_targets.number.command[1]: 5 is a number; quote it to make it a string",
        "probe_targets.number.timeout: must be a duration such as 5s or 500ms, not a number (write 5s)",
        "probe_targets.relative.command[0]: './nvidia-smi' is a relative path; "
        "give an absolute path or a name looked up on PATH",
        "probe_targets.relative.timeout: 20m is out of range (100ms to 10m)",
        "probe_targets.typo.comand: unknown key (known: command, timeout)",
        "probe_targets.typo.command: missing; give the argv to run, e.g. [/usr/bin/nvidia-smi]",
        "probe_targets.empty.command: must not be empty; give the argv to run, e.g. [/usr/bin/nvidia-smi]",
        "probe_targets.empty.timeout: 'fast' is not a duration (write it like 500ms, 5s or 1m30s)",
        "probe_targets.'../etc': not a valid target name "
        "(a letter or digit, then letters, digits, '_', '.' or '-'; at most 64 characters)",
        "probe_targets.not-a-mapping: must be a mapping with command (and optionally timeout), not a list",
        "probe_targets.blank-arg.command[1]: must not be empty",
    ]


@pytest.mark.parametrize("name", ["a", "gpu-07", "GPU_7.lab", "0", "x" * 64, "driver-root.v2"])
def test_valid_target_names(name: str) -> None:
    assert list(parse_config(f"probe_targets:\n  '{name}': {{command: [nvidia-smi]}}\n").probe_targets) == [name]


@pytest.mark.parametrize("name", [
    "x" * 65, "-rf", ".hidden", "_x", "a b", "a/b", "/usr/bin/nvidia-smi", "../x", "a;b", "$(id)", "a\\u00e9",
    "\\u0430", "a\\x00", "a\\n", "",
])
def test_invalid_target_names(name: str) -> None:
    (error,) = errors_of(f'probe_targets:\n  "{name}": {{command: [nvidia-smi]}}\n')
    assert error.startswith("probe_targets.") and "not a valid target name" in error


def test_a_non_string_name_is_refused() -> None:
    # YAML reads 007 as the number 7: the name the user meant would be lost.
    assert errors_of("probe_targets:\n  007: {command: [nvidia-smi]}\n") == [
        "probe_targets.'7': the name is a number; quote it to make it a string"
    ]


@pytest.mark.parametrize("text, error", [
    ("probe_targets: [a, b]\n", "probe_targets: must be a mapping of target names to targets, not a list"),
    ("- probe_targets\n", "the file must be a mapping of settings, not a list (known: probe_targets, engines)"),
    ("just text\n", "the file must be a mapping of settings, not a string (known: probe_targets, engines)"),
    ("probe_targets:\n  a: {command: [\"nvidia\\0smi\"]}\n", "probe_targets.a.command[0]: contains a NUL character"),
    ("probe_targets:\n  a: {command: [nvidia-smi], timeout: 50ms}\n",
     "probe_targets.a.timeout: 50ms is out of range (100ms to 10m)"),
])
def test_shape_errors(text: str, error: str) -> None:
    assert errors_of(text) == [error]


def test_yaml_syntax_error_names_the_line() -> None:
    (error,) = errors_of("probe_targets:\n  a:\n    command: [nvidia-smi\n")
    assert error.startswith("line 4, column 1: not valid YAML: ")


def test_yaml_tags_that_build_objects_are_refused() -> None:
    (error,) = errors_of("probe_targets: !!python/object/apply:os.system [id]\n")
    assert "not valid YAML" in error


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mig.yml"
    path.write_text("probe_targets:\n  a:\n    command: [nvidia-smi]\n    timeout: 2s\n")
    config = load_config(path)
    assert dict(config.probe_targets) == {"a": ProbeTarget("a", ("nvidia-smi",), 2.0)}
    assert config.source == str(path)


def test_load_config_of_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "missing.yml")
    assert raised.value.errors == ("cannot read: No such file or directory",)
    assert str(raised.value) == f"{tmp_path / 'missing.yml'}: cannot read: No such file or directory"


def test_a_fifo_as_the_config_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    # Opened for reading, a FIFO blocks until someone writes: one reload held a server thread
    # for ever, 80 of them the whole pool (issue 38). Without a writer this test would hang.
    fifo = tmp_path / "mig.yml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as raised:
        load_config(fifo)
    assert raised.value.errors == (
        "cannot read: a FIFO, not a regular file (a config file is read whole, once per reload)",)


def test_a_directory_or_a_device_as_the_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path)
    assert raised.value.errors == (
        "cannot read: a directory, not a regular file (a config file is read whole, once per reload)",)
    with pytest.raises(ConfigError) as raised:
        load_config("/dev/zero")
    assert raised.value.errors == (
        "cannot read: a device, not a regular file (a config file is read whole, once per reload)",)


# --- YAML the config may not use: anchors and aliases, deep nesting, a huge file ----------------

REFUSED = "anchors and aliases are not allowed in this file; write the value out in full"


@pytest.mark.parametrize("text, error", [
    ("a: &x 1\nb: *x\n", f"line 1, column 4: YAML anchor &x: {REFUSED}"),
    ("probe_targets:\n  a:\n    command: *x\n", f"line 3, column 14: YAML alias *x: {REFUSED}"),
    ("probe_targets:\n  a: &target\n    command: [nvidia-smi]\n  b: *target\n",
     f"line 2, column 6: YAML anchor &target: {REFUSED}"),
    ("probe_targets:\n  a: {<<: *base}\n", f"line 2, column 11: YAML alias *base: {REFUSED}"),
    ("x: &" + "a" * 100 + " 1\n", f"line 1, column 4: YAML anchor &{'a' * 40}...: {REFUSED}"),
])
def test_anchors_and_aliases_are_refused_naming_the_line(text: str, error: str) -> None:
    assert errors_of(text) == [error]


def test_nesting_deeper_than_32_levels_is_refused_naming_the_line() -> None:
    assert errors_of("[" * 5000 + "]" * 5000) == [
        "line 1, column 33: nested more than 32 levels deep; no setting in this file goes that deep"
    ]
    with pytest.raises(ConfigError, match="probe_targets: must be a mapping"):
        parse_config("probe_targets: " + "[" * 31 + "]" * 31)  # 32 levels with the top mapping: not refused


def test_a_file_over_1_mib_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "mig.yml"
    path.write_text("# a comment\n" * 100_000)  # 1.2 MB of valid YAML
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert raised.value.errors == ("larger than 1 MiB; a config file is a few KB (is it the right file?)",)
    # An endless device (/dev/zero) is refused before any read: not a regular file (below).
    path.write_text("# a comment\n" * 80_000 + "probe_targets:\n  a: {command: [nvidia-smi]}\n")  # 0.96 MB
    assert list(load_config(path).probe_targets) == ["a"]
