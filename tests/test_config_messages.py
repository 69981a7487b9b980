"""Every config file speaks with one voice. Whichever file and section a mistake is in
(``--config.file``'s probe targets or its engines section, ``--web.config.file``'s TLS, basic auth,
HTTP headers or rate limit), its error reads ``path.to.key: what is wrong (known: ...)``: the
path first, dotted, list items by index; then what is wrong; then, where it helps, the known keys
or values. The YAML's own errors name the line and column, and the file's the file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml

from certs import make_pki
from mig_exporter.config.checks import ConfigError
from mig_exporter.config.file import load_config, parse_config
from mig_exporter.web.webconfig import load_web_config, parse_web_config

_KEY = r"""(?:[A-Za-z0-9_-][A-Za-z0-9_.-]*|'[^']*'|"[^"]*")"""
SETTING = re.compile(rf"""
    (?P<path>{_KEY}(?:\.{_KEY}|\[\d+\])*)    # the path: keys joined by dots, list items by index
    :\ (?P<what>(?:(?!\(known:).)+?)         # what is wrong
    (?:\ \(known:\ (?P<known>[^()]+)\))?     # the keys or values that are known
    """, re.X)
YAML = re.compile(r"line \d+, column \d+: .+")
WHOLE_FILE = re.compile(r"cannot read: .+|larger than 1 MiB; .+|the file is empty .+"
                        r"|the file must be a mapping of settings, not .+ \(known: .+\)")

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def config_errors(document: Any) -> list[str]:
    return _errors(parse_config, yaml.safe_dump(document))


def web_errors(document: Any) -> list[str]:
    return _errors(parse_web_config, yaml.safe_dump(document))


def _errors(parse: Any, text: str) -> list[str]:
    try:
        parse(text, "x.yml")
    except ConfigError as e:
        assert e.errors, text
        return list(e.errors)
    return []


def valid_config() -> dict[str, Any]:
    return {
        "probe_targets": {"a": {"command": ["/usr/bin/nvidia-smi", "-i", "0"], "timeout": "5s"}},
        "engines": {"presets": {"vllm": False, "tgi": True},
                    "rules": [{"name": "x", "comm": "x-server", "exe": ["x"], "cmdline": ["^x"],
                               "gpu_offload": {"flags": ["-ngl"], "when_absent": True}}]},
    }


def valid_web(pki) -> dict[str, Any]:
    return {
        "tls_server_config": {
            "cert_file": str(pki.server.cert), "key_file": str(pki.server.key), "client_ca_file": str(pki.ca.cert),
            "client_auth_type": "RequireAndVerifyClientCert", "client_allowed_sans": ["prometheus"],
            "min_version": "TLS12", "max_version": "TLS13",
            "cipher_suites": ["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"],
            "prefer_server_cipher_suites": True, "curve_preferences": ["X25519", "CurveP256"],
        },
        "basic_auth_users": {"alice": HASH},
        "http_server_config": {"http2": False, "headers": {"X-Frame-Options": "deny"}},
        "rate_limit": {"interval": "1s", "burst": 5},
    }


# Each of these in place of each setting, in turn: most are the wrong kind somewhere.
WRONG_VALUES = [5, -1, 1.5, True, "", "nonsense", " 5s", ["x"], [1], [], {"x": 1}, {}, None, "a\nb"]


def leaves(document: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every value in the document, mappings and lists included."""
    found = [path] if path else []
    if isinstance(document, dict):
        for key, value in document.items():
            found += leaves(value, (*path, key))
    elif isinstance(document, list):
        for i, value in enumerate(document):
            found += leaves(value, (*path, i))
    return found


def replaced(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = dict(document) if isinstance(document, dict) else list(document)
    copy[path[0]] = replaced(document[path[0]], path[1:], value)
    return copy


def mistakes(document: Any) -> list[Any]:
    """The document with each value replaced by each wrong value, and with a key no reader knows
    added to each mapping."""
    out = [replaced(document, path, wrong) for path in leaves(document) for wrong in WRONG_VALUES]
    out += [replaced(document, path, {**value, "bogus": 1}) for path in leaves(document)
            if isinstance(value := _at(document, path), dict)]
    return [*out, {**document, "bogus": 1}]


def _at(document: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        document = document[key]
    return document


# Mistakes a person makes, beyond the wrong kind of value.
CONFIG_TEXTS = [
    "probe_targets:\n  a: {command: [nvidia-smi]}\n  a: {command: [nvidia-smi]}\n",
    "probe_targets:\n  '../etc': {command: [nvidia-smi]}\n  007: {command: [nvidia-smi]}\n",
    "probe_targets:\n  a: {command: [./nvidia-smi, \"a\\0b\", ''], timeout: 20m}\n  b: {timeout: 1d}\n",
    "probe_targets:\n  a: {command: nvidia-smi -q, timeout: 50ms}\n",
    "engines:\n  presets: {llama: true, vllm: maybe}\n  rules: [{name: bad name, comm: text-generation-launcher}]\n",
    "engines:\n  rules: [{name: x}, {name: y, cmdline: ['(']}, {name: z, exe: x, gpu_offload: {flags: [ngl]}}]\n",
    "engines:\n  rules: [{name: x, exe: x, gpu_offload: {when_absent: maybe}}, {exe: x, bogus: 1}]\n",
    "engines: {rules: [{name: x, comm: x}], rules: []}\n",
    "- probe_targets\n",
    "probe_targets: [\n",
    "probe_targets: &a {}\nengines: *a\n",
    "[" * 40 + "]" * 40,
]
WEB_TEXTS = [
    "tls_server_config: {cert_file: a}\n",
    "tls_server_config: {cert: a, cert_file: a, key: b, key_file: b, client_ca: c, client_ca_file: c}\n",
    "tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireAnyClientCert}\n",
    "tls_server_config: {cert_file: a, key_file: b, client_ca_file: c}\n",
    "tls_server_config: {cert_file: a, key_file: b, client_allowed_sans: [x]}\n",
    "tls_server_config: {cert_file: a, key_file: b, min_version: TLS13, max_version: TLS12}\n",
    "tls_server_config: {cert_file: a, key_file: b, min_version: TLS9, cipher_suites: [RC4]}\n",
    "tls_server_config: {cert_file: a, key_file: b, curve_preferences: [P1]}\n",
    "tls_server_config: {cert_file: /nonexistent/a.crt, key_file: /nonexistent/b.key}\n",
    "basic_auth_users: {alice: hunter2, bob: '$2y$03$" + "a" * 53 + "', 7: x}\n",
    "basic_auth_users: {alice: x}\nbasic_auth_users: {}\n",
    "http_server_config: {headers: {X-Powered-By: me, X-Frame-Options: allow, X-XSS-Protection: [1]}}\n",
    "rate_limit: {interval: 1s, burst: 0}\n",
    "rate_limit: {interval: fast, burst: many}\n",
    "auth_excluded_paths: [/]\n",
    "just text\n",
    "basic_auth_users: {alice: &h x, bob: *h}\n",
]


@pytest.fixture(scope="module")
def messages(pki, tmp_path_factory) -> dict[str, list[str]]:
    """Every error message of every mistake above, by reader."""
    found: dict[str, list[str]] = {"config": [], "web": [], "file": []}
    for document in mistakes(valid_config()):
        found["config"] += config_errors(document)
    for text in CONFIG_TEXTS:
        found["config"] += _errors(parse_config, text)
    for document in mistakes(valid_web(pki)):
        found["web"] += web_errors(document)
    for text in WEB_TEXTS:
        found["web"] += _errors(parse_web_config, text)
    # Certificates that do not load, found only when the context is made.
    wrong = tmp_path_factory.mktemp("wrong")
    (wrong / "not.pem").write_text("hello\n")
    for tls in ({"key_file": str(pki.client.key)}, {"client_ca_file": str(wrong / "not.pem")}):
        document = valid_web(pki)
        document["tls_server_config"].update(tls)
        found["web"] += web_errors(document)
    big = wrong / "big.yml"
    big.write_text("# a comment\n" * 100_000)
    for load in (load_config, load_web_config):
        for path in (wrong / "missing.yml", big, wrong):
            with pytest.raises(ConfigError) as raised:
                load(path)
            found["file"] += raised.value.errors
    return found


def test_every_message_has_one_of_the_three_shapes(messages):
    for reader, lines in messages.items():
        for line in lines:
            assert SETTING.fullmatch(line) or YAML.fullmatch(line) or WHOLE_FILE.fullmatch(line), (reader, line)
            assert "\n" not in line and "got " not in line and "unknown setting" not in line, line
    every = {line for lines in messages.values() for line in lines}
    assert len(every) > 250, "the mistakes above should find many different messages"


def test_the_path_starts_at_the_top_of_the_file(messages):
    """A setting's path is the same from every reader: from the top of the file, never
    relative to its section."""
    tops = {"config": ("probe_targets", "engines", "bogus"),
            "web": ("tls_server_config", "basic_auth_users", "http_server_config", "rate_limit", "bogus",
                    "auth_excluded_paths")}
    for reader, top in tops.items():
        for line in messages[reader]:
            if (m := SETTING.fullmatch(line)) and not YAML.fullmatch(line) and not WHOLE_FILE.fullmatch(line):
                assert re.split(r"[.\[]", m["path"])[0] in top, line


def test_unknown_keys_and_values_name_the_known_ones(messages):
    for line in (line for lines in messages.values() for line in lines):
        if ": unknown " in line and "cipher suite" not in line:
            m = SETTING.fullmatch(line)
            assert m and m["known"], line


def test_the_same_mistake_reads_the_same_in_every_file(pki):
    config, web = valid_config(), valid_web(pki)
    config["probe_targets"]["a"]["bogus"] = 1
    config["engines"]["bogus"] = 1
    config["engines"]["rules"][0]["gpu_offload"]["bogus"] = 1
    web["tls_server_config"]["bogus"] = 1
    web["rate_limit"]["bogus"] = 1
    assert config_errors(config) == [
        "probe_targets.a.bogus: unknown key (known: command, timeout)",
        "engines.bogus: unknown key (known: presets, rules)",
        "engines.rules[0].gpu_offload.bogus: unknown key (known: flags, when_absent)",
    ]
    assert web_errors(web) == [
        "tls_server_config.bogus: unknown key (known: cert, key, client_ca, cert_file, key_file, client_auth_type, "
        "client_ca_file, client_allowed_sans, min_version, max_version, cipher_suites, prefer_server_cipher_suites, "
        "curve_preferences)",
        "rate_limit.bogus: unknown key (known: interval, burst)",
    ]
    assert config_errors(replaced(valid_config(), ("probe_targets", "a", "timeout"), 5)) == [
        "probe_targets.a.timeout: must be a duration such as 5s or 500ms, not a number (write 5s)"]
    assert web_errors(replaced(valid_web(pki), ("rate_limit", "interval"), 5)) == [
        "rate_limit.interval: must be a duration such as 5s or 500ms, not a number (write 5s)"]
    assert config_errors(replaced(valid_config(), ("engines", "presets", "vllm"), "no")) == [
        "engines.presets.vllm: must be true or false, not a string"]
    assert web_errors(replaced(valid_web(pki), ("http_server_config", "http2"), "no")) == [
        "http_server_config.http2: must be true or false, not a string"]
    assert config_errors(replaced(valid_config(), ("engines", "rules", 0, "exe", 0), 7)) == [
        "engines.rules[0].exe[0]: 7 is a number; quote it to make it a string"]
    assert web_errors(replaced(valid_web(pki), ("tls_server_config", "client_allowed_sans", 0), 7)) == [
        "tls_server_config.client_allowed_sans[0]: 7 is a number; quote it to make it a string"]


def test_a_key_given_twice_is_named_by_its_path():
    assert _errors(parse_config, "probe_targets:\n  a: {command: [x]}\n  a: {command: [y]}\n") == [
        "probe_targets.a: given twice (first on line 2, again on line 3)"]
    assert _errors(parse_web_config, f"basic_auth_users:\n  alice: {HASH}\n  alice: {HASH}\n") == [
        "basic_auth_users.alice: given twice (first on line 2, again on line 3)"]
    assert _errors(parse_config, "engines:\n  rules:\n    - {name: x, comm: x, comm: y}\n") == [
        "engines.rules[0].comm: given twice (first on line 3, again on line 3)"]


def test_yaml_and_file_errors_name_the_line_or_the_file(tmp_path: Path):
    assert _errors(parse_config, "probe_targets: [\n") == [
        "line 2, column 1: not valid YAML: expected the node content, but found '<stream end>'"]
    assert _errors(parse_web_config, "rate_limit: {interval: *i}\n") == [
        "line 1, column 24: YAML alias *i: anchors and aliases are not allowed in this file; "
        "write the value out in full"]
    with pytest.raises(ConfigError) as raised:
        load_web_config(tmp_path / "missing.yml")
    assert str(raised.value) == f"{tmp_path / 'missing.yml'}: cannot read: No such file or directory"


def test_a_date_that_is_no_date_is_an_error_line_not_a_crash():
    """PyYAML builds timestamps itself and raises ValueError for 2020-02-30."""
    with pytest.raises(ConfigError) as e:
        parse_web_config("basic_auth_users:\n  bob: 2020-02-30\n")
    assert str(e.value) == "<web config>: not valid YAML: 'day is out of range for month'"


@pytest.mark.parametrize(("value", "hint"), [("5", "(write 5s)"), ("0.5", "(write 500ms)"), ("-1", "")])
def test_a_bare_number_for_a_duration_hints_only_at_what_would_be_taken(value, hint):
    [message] = _errors(parse_web_config, f"rate_limit:\n  interval: {value}\n  burst: 1\n")
    assert message.endswith(hint) if hint else "write" not in message
