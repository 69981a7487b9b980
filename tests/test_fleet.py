"""``mig-exporter fleet`` against the setups it meets: a real Prometheus (Debian's binary) that
scrapes real exporters over fake nvidia-smis, reached as operators reach theirs.

- behind basic auth: Prometheus' own ``--web.config.file`` with ``basic_auth_users`` (a bcrypt
  hash, made with the ``bcrypt`` the package already depends on);
- behind a Mimir-style tenant check: a small reverse proxy that answers as Mimir does when
  ``X-Scope-OrgID`` is missing, and forwards when it is there;
- over HTTPS: Prometheus' own ``tls_server_config``, with the test CA of tests/certs.py, and a
  kube-rbac-proxy-style TLS gate that wants a bearer token.

Every failing run's stdout and stderr are searched for each secret (password, token, header
value): none may show. The scenario is tests/test_capacity.py's: node A with a free 3g.40gb
instance (and the demo's idle 1g.10gb), node B the demo as it is (its 3g.40gb in use).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
import yaml

from certs import Pki, make_pki
from conftest import SAMPLES
from mig_exporter.fleet import QUERIES, Queries, as_json, read_fleet
from mig_exporter.prometheus_api import PASSWORD_ENV, Access, FleetError, FleetUsageError, PrometheusClient
from proc_tree import make_proc
from test_capacity import LISTING, ONE_G, THREE_G, free_three_g_xml
from test_prometheus import HOST, JOB, STARTUP_S, _free_port, _prometheus_binary, _stop, exporter, wait_ready

pytestmark = pytest.mark.prometheus

TWO_G = "a100-80g-mig-2g.20gb"
WHOLE = "a100-80g"
PASSWORD = "pa55-Zq81-horse-battery"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.tok3n-Vx7.sig"
TENANT = "tenant-gpu-eu1"


# --- running fleet -----------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``mig-exporter fleet ARGS``, with none of the caller's MIG_EXPORTER_* variables and ``env``'s."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MIG_EXPORTER_")}
    return subprocess.run([sys.executable, "-m", "mig_exporter", "fleet", *args], capture_output=True, text=True,
                          timeout=30, env=clean | (env or {}))


def _fails(done: subprocess.CompletedProcess[str], code: int, *secrets: str) -> str:
    """The run exited ``code`` with one error line, no traceback and none of ``secrets``; its stderr."""
    out = done.stdout + done.stderr
    assert done.returncode == code, (done.returncode, out)
    assert "Traceback" not in out, out
    for secret in (PASSWORD, TOKEN, TENANT, *secrets):
        assert secret not in out, f"{secret!r} shows in:\n{out}"
    assert done.stderr.startswith("mig-exporter: error: "), done.stderr
    return done.stderr


def _answers(done: subprocess.CompletedProcess[str], code: int = 0) -> dict:
    assert done.returncode == code, done.stdout + done.stderr
    return json.loads(done.stdout)


def _by_class(answer: dict) -> dict[str, tuple[int, int, int, int]]:
    return {c["class"]: (c["devices"], c["free"], c["in_use"], c["unknown"]) for c in answer["classes"]}


# The scenario's classes, each (devices, free, in use, unknown) with nodes A and B both reporting.
BOTH = {THREE_G: (2, 1, 1, 0), TWO_G: (2, 0, 2, 0), ONE_G: (2, 2, 0, 0), WHOLE: (2, 0, 2, 0)}


# --- the fleet and its Prometheus --------------------------------------------------------------


@dataclass
class Node:
    address: str
    smi: Path
    proc: str
    process: subprocess.Popen


@contextmanager
def fleet_nodes(fake_nvidia_smi, tmp_path: Path, *names: str) -> Iterator[dict[str, Node]]:
    """Exporters over fake nvidia-smis, each seeing the host's PIDs: ``a`` (a free 3g.40gb) and
    ``b`` (the demo as it is, its 3g.40gb in use), or ``a2`` (another like a)."""
    proc = str(make_proc(tmp_path / "proc", []))
    xml = {"a": free_three_g_xml(), "a2": free_three_g_xml(), "b": (SAMPLES / "demo.xml").read_bytes()}
    with ExitStack() as stack:
        nodes = {}
        for name in names:
            smi = fake_nvidia_smi(xml[name], LISTING)
            e = stack.enter_context(exporter(smi, tmp_path, "--no-kubernetes", "--proc.root", proc))
            nodes[name] = Node(e.address, smi, proc, e.process)
        yield nodes


@dataclass
class Server:
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@contextmanager
def real_prometheus(tmp_path: Path, targets: list[str], web_config: dict | None = None,
                    ready: Callable[[str], urllib.request.Request] | None = None,
                    context: ssl.SSLContext | None = None, job: dict | None = None) -> Iterator[Server]:
    """Debian's Prometheus scraping ``targets`` each second (or as ``job`` says), with
    ``web_config`` as its ``--web.config.file`` (basic auth, TLS); ready once ``/-/ready``
    answers 200 to ``ready(url)``."""
    binary = _prometheus_binary()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [job or {"job_name": JOB, "static_configs": [{"targets": targets}]}],
    }))
    args = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    if web_config is not None:
        web = tmp_path / "web.yml"
        web.write_text(yaml.safe_dump(web_config))
        args.append(f"--web.config.file={web}")
    port = _free_port()
    scheme = "https" if web_config and "tls_server_config" in web_config else "http"
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([*args, f"--web.listen-address={HOST}:{port}"], stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=subprocess.STDOUT, cwd=tmp_path)
    server = Server(f"{scheme}://{HOST}:{port}", log_path)
    try:
        request = ready(f"{server.url}/-/ready") if ready else urllib.request.Request(f"{server.url}/-/ready")
        wait_ready("prometheus", process, request, server.log, context)
        yield server
    finally:
        _stop(process)


def _until(url: str, expected: dict, access: Access | None = None, queries: Queries = QUERIES,
           device_class: str | None = None) -> dict:
    """fleet's answer (in this process), once its classes are ``expected`` (bounded by STARTUP_S)."""
    client = PrometheusClient(url, 5.0, access)
    deadline = time.monotonic() + STARTUP_S
    while True:
        answer = as_json(read_fleet(client, device_class, devices=device_class is not None, queries=queries))
        if _by_class(answer) == expected or time.monotonic() > deadline:
            assert _by_class(answer) == expected, answer
            return answer
        time.sleep(0.25)


class Gate(http.server.ThreadingHTTPServer):
    """A reverse proxy in front of a Prometheus: ``refuse(headers)`` gives (status, body) to
    answer as the real gateway does, or None to forward the request upstream as it came."""

    daemon_threads = True

    def __init__(self, upstream: str, refuse: Callable[[dict[str, str]], tuple[int, str] | None],
                 tls: Pki | None = None) -> None:
        self.upstream, self.refuse, self.seen = upstream, refuse, []
        self.upstream_context = ssl.create_default_context(cafile=str(tls.ca.cert)) if tls else None
        super().__init__((HOST, 0), _GateHandler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls.server.cert), str(tls.server.key))
            self.socket = context.wrap_socket(self.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://{HOST}:{self.server_address[1]}"


class _GateHandler(http.server.BaseHTTPRequestHandler):
    server: Gate

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.seen.append(headers)
        refused = self.server.refuse(headers)
        if refused is not None:
            # Go's http.Error: the text and a newline, as text/plain, nosniff.
            status, text = refused
            payload = (text + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        forwarded = urllib.request.Request(self.server.upstream + self.path, data=body, method="POST",
                                           headers={"Content-Type": self.headers.get("Content-Type", "")})
        try:
            with urllib.request.urlopen(forwarded, timeout=10, context=self.server.upstream_context) as r:
                status, payload = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def gate(upstream: str, refuse: Callable[[dict[str, str]], tuple[int, str] | None],
         tls: Pki | None = None) -> Iterator[Gate]:
    server = Gate(upstream, refuse, tls)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# --- (a) basic auth ----------------------------------------------------------------------------


def test_fleet_behind_prometheus_basic_auth_answers_with_credentials_and_shows_none(fake_nvidia_smi, tmp_path):
    """Prometheus' own basic_auth_users: without credentials HTTP 401, exit 3; with the password
    from a file or the environment, the answer; credentials in the URL refused (exit 2)."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    basic = "Basic " + base64.b64encode(f"planner:{PASSWORD}".encode()).decode()
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")  # a trailing newline, as `echo` writes: stripped
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("not-the-pa55word-Kq2\n")
    with fleet_nodes(fake_nvidia_smi, tmp_path, "a", "b") as nodes, real_prometheus(
            tmp_path, [n.address for n in nodes.values()], {"basic_auth_users": {"planner": hashed}},
            ready=lambda url: urllib.request.Request(url, headers={"Authorization": basic})) as prom:
        _until(prom.url, BOTH, Access(basic_auth=("planner", PASSWORD)))

        stderr = _fails(_cli("--prometheus", prom.url), 3)
        assert f"{prom.url}/api/v1/query: HTTP 401: Unauthorized" in stderr
        assert "--prometheus.basic-auth-user" in stderr  # the hint: which options carry credentials
        _fails(_cli("--prometheus", prom.url, "--prometheus.basic-auth-user", "planner",
                    "--prometheus.password-file", str(wrong_file)), 3, "not-the-pa55word-Kq2")
        _fails(_cli("--prometheus", prom.url, "--prometheus.basic-auth-user", "planner"), 2)  # no password

        by_file = _answers(_cli("--prometheus", prom.url, "--prometheus.basic-auth-user", "planner",
                                "--prometheus.password-file", str(password_file), "--output", "json"))
        assert _by_class(by_file) == BOTH
        by_env = _cli("--prometheus", prom.url, "--class", THREE_G,
                      env={"MIG_EXPORTER_PROMETHEUS_BASIC_AUTH_USER": "planner",
                           "MIG_EXPORTER_PROMETHEUS_BASIC_AUTH_PASSWORD": PASSWORD})
        assert by_env.returncode == 0 and f"  {nodes['a'].address}  1 free" in by_env.stdout, by_env.stderr

        # In the URL: refused before asking, and never echoed (userinfo shown as ***).
        in_url = prom.url.replace("://", f"://planner:{PASSWORD}@")
        stderr = _fails(_cli("--prometheus", in_url), 2)
        assert f"http://***@{HOST}" in stderr and "credentials in the URL are refused" in stderr
        stderr = _fails(_cli(env={"MIG_EXPORTER_PROMETHEUS_URL": in_url}), 2)
        assert "credentials in the URL are refused" in stderr


# --- (b) a Mimir-style tenant header -----------------------------------------------------------


def mimir_tenant_check(headers: dict[str, str]) -> tuple[int, str] | None:
    """Mimir with multitenancy on (its default): grafana/mimir pkg/util/fakeauth/fake_auth.go,
    SetupAuthMiddleware, returns dskit's middleware.AuthenticateUser (middleware/http_auth.go),
    which answers ``http.Error(w, err.Error(), http.StatusUnauthorized)`` when
    user.ExtractOrgIDFromHTTPRequest finds no X-Scope-OrgID (user/http.go), err being
    user.ErrNoOrgID = errors.New("no org id") (user/id.go): 401, ``no org id``, text/plain."""
    return None if headers.get("x-scope-orgid") else (401, "no org id")


def test_fleet_sends_a_mimir_tenant_header_and_says_what_mimir_answered_without_it(fake_nvidia_smi, tmp_path):
    with fleet_nodes(fake_nvidia_smi, tmp_path, "a", "b") as nodes, \
            real_prometheus(tmp_path, [n.address for n in nodes.values()]) as prom, \
            gate(prom.url, mimir_tenant_check) as mimir:
        _until(prom.url, BOTH)
        stderr = _fails(_cli("--prometheus", mimir.url), 3)
        assert f"{mimir.url}/api/v1/query: HTTP 401: no org id" in stderr
        assert "--prometheus.header X-Scope-OrgID:TENANT" in stderr  # the hint names the header

        answer = _answers(_cli("--prometheus", mimir.url, "--prometheus.header", f"X-Scope-OrgID:{TENANT}",
                               "--class", ONE_G, "--output", "json"))
        assert _by_class(answer) == BOTH
        assert sorted(n["instance"] for n in answer["nodes"]) == sorted(n.address for n in nodes.values())
        assert mimir.seen[-1]["x-scope-orgid"] == TENANT
        # From the environment, one header a line; several tenants are one value, as Mimir takes them.
        by_env = _cli("--prometheus", mimir.url, env={
            "MIG_EXPORTER_PROMETHEUS_HEADER": f"X-Scope-OrgID: {TENANT}|other\nX-Planner: fleet-test\n"})
        assert by_env.returncode == 0, by_env.stderr
        assert (mimir.seen[-1]["x-scope-orgid"], mimir.seen[-1]["x-planner"]) == (f"{TENANT}|other", "fleet-test")

    # Refused before asking, the value never echoed: a line break (header injection), a header
    # fleet sets itself, one given twice; and a header with a Prometheus that cannot be reached.
    unreachable = f"http://{HOST}:{_free_port()}"
    for header in (f"X-Scope-OrgID:{TENANT}\r\nX-Injected: {TENANT}", f"X-Scope-OrgID:{TENANT}\nA:{TENANT}",
                   f"Content-Length:{TENANT}", f"{TENANT}", f"Bad Name:{TENANT}"):
        _fails(_cli("--prometheus", unreachable, "--prometheus.header", header), 2)
    twice = _cli("--prometheus", unreachable, "--prometheus.header", f"X-Scope-OrgID:{TENANT}",
                 "--prometheus.header", f"x-scope-orgid:{TENANT}")
    assert "given twice" in _fails(twice, 2)
    assert "cannot reach it" in _fails(_cli("--prometheus", unreachable, "--prometheus.header",
                                            f"X-Scope-OrgID:{TENANT}"), 3)


# --- (c) HTTPS with a CA file, and a bearer token ----------------------------------------------


def kube_rbac_proxy_check(headers: dict[str, str]) -> tuple[int, str] | None:
    """kube-rbac-proxy (brancz/kube-rbac-proxy pkg/filters/auth.go, WithAuthentication): a
    request its authenticator does not accept (no token, or a wrong one) gets
    ``http.Error(w, "Unauthorized", http.StatusUnauthorized)``."""
    return None if headers.get("authorization") == f"Bearer {TOKEN}" else (401, "Unauthorized")


def test_fleet_over_https_with_a_ca_file_and_behind_a_bearer_token_gate(fake_nvidia_smi, tmp_path):
    pki = make_pki(tmp_path / "pki")
    ca = str(pki.ca.cert)
    token_file, wrong_token = tmp_path / "token", tmp_path / "wrong-token"
    token_file.write_text(TOKEN + "\n")
    wrong_token.write_text("eyJ-not-it-Rr55\n")
    tls = {"tls_server_config": {"cert_file": str(pki.server.cert), "key_file": str(pki.server.key)}}
    with fleet_nodes(fake_nvidia_smi, tmp_path, "a", "b") as nodes, real_prometheus(
            tmp_path, [n.address for n in nodes.values()], tls,
            context=ssl.create_default_context(cafile=ca)) as prom:
        assert prom.url.startswith("https://")
        _until(prom.url, BOTH, Access(ca_file=ca))

        stderr = _fails(_cli("--prometheus", prom.url), 3)
        assert "TLS: the server's certificate is not trusted" in stderr and "--prometheus.ca-file" in stderr
        assert _by_class(_answers(_cli("--prometheus", prom.url, "--prometheus.ca-file", ca, "--output",
                                       "json"))) == BOTH
        # Plain HTTP to the TLS port: Go's server answers 400 with "Client sent an HTTP request to
        # an HTTPS server." and closes at once; while the query is still being sent, the close can
        # cut that body off, and the status line's reason is all there is.
        plain = prom.url.replace("https://", "http://")
        assert re.search(r"HTTP 400: (Client sent an HTTP request to an HTTPS server\.|Bad Request)$",
                         _fails(_cli("--prometheus", plain), 3), re.M)
        assert "verifies an https:// server" in _fails(_cli("--prometheus", plain, "--prometheus.ca-file", ca), 2)
        not_pem = tmp_path / "not-a-ca.pem"
        not_pem.write_text("hello\n")
        assert "cannot load it as PEM" in _fails(_cli("--prometheus", prom.url, "--prometheus.ca-file",
                                                      str(not_pem)), 2)

        with gate(prom.url, kube_rbac_proxy_check, tls=pki) as rbac:
            common = ("--prometheus", rbac.url, "--prometheus.ca-file", ca)
            assert "HTTP 401: Unauthorized" in _fails(_cli(*common), 3)
            _fails(_cli(*common, "--prometheus.bearer-token-file", str(wrong_token)), 3, "eyJ-not-it-Rr55")
            answer = _answers(_cli(*common, "--prometheus.bearer-token-file", str(token_file), "--class", THREE_G,
                                   "--output", "json"))
            assert [(n["instance"], n["free"]) for n in answer["nodes"]] == [(nodes["a"].address, 1)]
            assert rbac.seen[-1]["authorization"] == f"Bearer {TOKEN}"
            # One way of authenticating; a token file that is not there.
            password_file = tmp_path / "password"
            password_file.write_text(PASSWORD)
            both = _cli(*common, "--prometheus.bearer-token-file", str(token_file), "--prometheus.basic-auth-user",
                        "planner", "--prometheus.password-file", str(password_file))
            assert "give one way of authenticating" in _fails(both, 2)
            assert "cannot read it" in _fails(_cli(*common, "--prometheus.bearer-token-file",
                                                   str(tmp_path / "absent")), 2)


# --- (d) exit codes ----------------------------------------------------------------------------


def test_fleet_exit_codes_say_free_none_free_unknown_class_and_could_not_ask(fake_nvidia_smi, tmp_path):
    with fleet_nodes(fake_nvidia_smi, tmp_path, "a", "b") as nodes, \
            real_prometheus(tmp_path, [n.address for n in nodes.values()]) as prom:
        _until(prom.url, BOTH)
        # 0: answered; with --class, one is free.
        whole = _answers(_cli("--prometheus", prom.url, "--output", "json"))
        assert _by_class(whole) == BOTH and whole["not_reporting"] == [] and "nodes" not in whole
        text = _cli("--prometheus", prom.url, "--class", THREE_G)
        assert text.returncode == 0, text.stderr
        assert re.search(rf"^{re.escape(THREE_G)}\s+2\s+1\s+1\s+0\s+[\d.]+ GiB$", text.stdout, re.M), text.stdout
        assert re.search(r"^CLASS\s+DEVICES\s+FREE\s+IN USE\s+UNKNOWN\s+MEMORY FREE$", text.stdout, re.M)
        assert f"Nodes with a free {THREE_G} now:\n  {nodes['a'].address}  1 free\n" in text.stdout
        assert "Nodes not reporting (seen within 1h, not now): none" in text.stdout

        # 1: a class the Prometheus has, none of it free: the answer is printed all the same.
        none_free = _answers(_cli("--prometheus", prom.url, "--class", WHOLE, "--output", "json"), code=1)
        assert none_free["class"] == WHOLE and none_free["nodes"] == []
        text = _cli("--prometheus", prom.url, "--class", WHOLE, "--devices")
        assert text.returncode == 1 and f"No {WHOLE} is free now." in text.stdout

        # 2: a class it has no device of, named with the ones it has; a class no PromQL string
        # could hold is quoted and simply matches none.
        stderr = _fails(_cli("--prometheus", prom.url, "--class", "h200-141g"), 2)
        assert f"no device of class 'h200-141g'; its classes: {WHOLE}, {ONE_G}, {TWO_G}, {THREE_G}" in stderr
        assert "its classes" in _fails(_cli("--prometheus", prom.url, "--class", 'x"} or vector(1) #'), 2)
        assert "give --class" in _fails(_cli("--prometheus", prom.url, "--devices"), 2)

        # 3: not a Prometheus (an exporter's port has no query API).
        stderr = _fails(_cli("--prometheus", f"http://{nodes['a'].address}"), 3)
        assert f"http://{nodes['a'].address}/api/v1/query: HTTP 404" in stderr


def test_fleet_names_the_url_and_the_reason_when_it_cannot_ask(tmp_path):
    refused = _cli("--prometheus", "http://127.0.0.1:9")
    assert "http://127.0.0.1:9/api/v1/query: cannot reach it: Connection refused" in _fails(refused, 3)
    assert "not an http:// or https:// URL" in _fails(_cli("--prometheus", "prometheus:9090"), 2)
    assert "no ?query" in _fails(_cli("--prometheus", f"http://prom:9090/?token={TOKEN}"), 2)


def test_fleet_says_what_a_prometheus_error_was(fake_nvidia_smi, tmp_path):
    """A real Prometheus refusing a query: its JSON error, said with the URL."""
    with fleet_nodes(fake_nvidia_smi, tmp_path, "a") as nodes, \
            real_prometheus(tmp_path, [nodes["a"].address]) as prom, \
            pytest.raises(FleetError, match=r"/api/v1/query: HTTP 400: bad_data: .*parse error"):
        PrometheusClient(prom.url).query("sum(")


@pytest.mark.parametrize(("body", "says"), [
    (b'{"status": "success", "data": []}', "expected an instant vector, got 'list'"),
    (b'{"status": "success", "data": {"resultType": "matrix", "result": []}}', "got 'matrix'"),
    (b'{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "x"]}]}}',
     "not a Prometheus instant vector's"),
    (b"<html>not json</html>", "the answer is not JSON"),
    (b'{"status": "error", "errorType": "timeout", "error": "query timed out"}', "timeout: query timed out"),
])
def test_fleet_refuses_an_answer_that_is_not_prometheus_with_a_reason(body, says):
    """Something at the URL that answers 200 but not as Prometheus does (a proxy, another API)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(FleetError, match=re.escape(says)) as raised:
            PrometheusClient(url).query("up")
        assert f"{url}/api/v1/query: " in str(raised.value)
        done = _cli("--prometheus", url)
        assert says in _fails(done, 3)
    finally:
        server.shutdown()
        server.server_close()


def test_fleet_refuses_a_url_with_a_bad_port_without_a_traceback():
    assert "http://prom:90x0: not a URL" in _fails(_cli("--prometheus", "http://prom:90x0"), 2)
    assert "http://prom:99999: not a URL: its port is not a number 0-65535" in _fails(
        _cli("--prometheus", "http://prom:99999"), 2)
    stderr = _fails(_cli("--prometheus", f"http://planner:{PASSWORD}@prom:90x0"), 2)
    assert "http://***@prom:90x0: credentials in the URL are refused" in stderr
    with pytest.raises(FleetUsageError, match="not a URL"):
        PrometheusClient("http://prom:90x0")


# Passwords holding what ends urllib's user information early ('#', '/', '?'), an '@' (the user
# information ends at the last), a ':', and a URL without a scheme. Each piece is searched for too:
# "http://admin:Qx7#vK2m@prom:9090" once showed as "http://admin:Qx7: not a URL: ... as 'Qx7'".
@pytest.mark.parametrize("password", ["Qx7#vK2m", "Qx7/vK2m", "Qx7?vK2m", "Qx7@vK2m", "Qx7:vK2m", "Qx7#v/K?2@m:"])
def test_credentials_in_the_url_are_refused_and_no_piece_of_the_password_shows(password):
    pieces = (password, "admin", *(p for p in re.split(r"[#/?@:]", password) if len(p) >= 3))
    for shape in ("http://admin:{}@prom:9090", "https://admin:{}@prom/prefix", "admin:{}@prom:9090",
                  "http://admin:{}@prom:90x0", "http://admin:{}@prom:9090/?q=1#f", "http://admin:{}@[::1/"):
        with pytest.raises(FleetUsageError, match="credentials in the URL are refused") as raised:
            PrometheusClient(shape.format(password))
        assert "***@" in str(raised.value)
        assert not [p for p in pieces if p in str(raised.value)], str(raised.value)
    url = f"http://admin:{password}@prom:9090"
    for done in (_cli("--prometheus", url), _cli(env={"MIG_EXPORTER_PROMETHEUS_URL": url})):
        stderr = _fails(done, 2, *pieces)
        assert "http://***@prom:9090: credentials in the URL are refused" in stderr


def test_an_error_body_that_echoes_a_secret_is_shown_without_it():
    """A gateway that echoes the request's headers in its error (some do, to help debugging):
    the message keeps the rest, the secrets are cut out."""

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            payload = f"denied: {self.headers.get('Authorization')} {self.headers.get('X-Scope-OrgID')}\x1b[31m"
            self.send_response(403)
            self.send_header("Content-Length", str(len(payload.encode())))
            self.end_headers()
            self.wfile.write(payload.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((HOST, 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://{HOST}:{server.server_address[1]}"
        for access in (Access(basic_auth=("planner", PASSWORD), headers=(("X-Scope-OrgID", TENANT),)),
                       Access(bearer_token=TOKEN, headers=(("X-Scope-OrgID", TENANT),))):
            with pytest.raises(FleetError) as raised:
                PrometheusClient(url, access=access).query("up")
            message = str(raised.value)
            assert "HTTP 403: denied: " in message and "<redacted>" in message
            assert PASSWORD not in message and TOKEN not in message and TENANT not in message
            assert "\x1b" not in message and "\\x1b[31m" in message  # a terminal escape, shown escaped
            assert PASSWORD not in repr(access) and TOKEN not in repr(access) and TENANT not in repr(access)
    finally:
        server.shutdown()
        server.server_close()


# A Kubernetes service-account token is a JWT of about 900 characters; a header value may hold a tab,
# and so may a password, which a gateway may echo as it decoded it.
LONG_TOKEN = "eyJhbGciOiJSUzI1NiIsImtpZCI6Ik" + "".join(
    base64.urlsafe_b64encode(hashlib.sha512(str(i).encode()).digest()).decode().rstrip("=") for i in range(11))[:870]
TAB_TENANT = "tenant\tgpu-Wq4-eu1"
TAB_PASSWORD = "pa55\tZq81-horse-Kv9"


def _no_piece(out: str, *secrets: str) -> None:
    """No 8 characters in a row of any secret show, as sent, escaped for a terminal or as JSON writes it."""
    for secret in secrets:
        for form in {secret, secret.replace("\t", "\\t")}:
            shown = [form[i:i + 8] for i in range(len(form) - 7) if form[i:i + 8] in out]
            assert not shown, f"{shown[:3]} of a secret show in:\n{out}"


class EchoingGate(http.server.BaseHTTPRequestHandler):
    """A gateway that says what it was sent, the way the URL's path asks (``/MODE/PAD/api/v1/query``):
    ``text`` a 401 with the echo in a text body, ``json`` a 403 with it in Prometheus' JSON error,
    ``reason`` a 401 with it in the status line and no body, ``redirect`` a 302 whose Location holds
    it. PAD characters come first, so the secrets straddle the 200 characters a message shows."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode, pad = self.path.split("/")[1:3]
        auth = self.headers.get("Authorization", "")
        said = f"{auth} tenant={self.headers.get('X-Scope-OrgID')}"
        if auth.startswith("Basic "):
            said += f" as {base64.b64decode(auth[6:]).decode()}"
        said = "." * int(pad) + " " + said
        body = b""
        if mode == "text":
            self.send_response(401)
            body = f"denied: {said}\n".encode()
        elif mode == "json":
            self.send_response(403)
            body = json.dumps({"status": "error", "errorType": "forbidden", "error": said}).encode()
        elif mode == "reason":
            self.send_response(401, f"Denied {said}")
        else:
            self.send_response(302)
            self.send_header("Location", f"http://{HOST}:1/login/{said.replace(' ', '/')}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def echoing_gate() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer((HOST, 0), EchoingGate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("mode", ["text", "json", "reason", "redirect"])
def test_a_long_token_or_a_secret_with_a_tab_echoed_back_shows_no_piece_of_itself(echoing_gate, mode, tmp_path):
    """Each secret is cut out of the server's text before that is escaped (a tab as \\t) and cut to
    200 characters: cut first, a 900-character token's beginning showed; escaped first, a secret
    with a tab was never found. Wherever the cut falls (PAD), no 8 characters of one show."""
    basic = base64.b64encode(f"planner:{TAB_PASSWORD}".encode()).decode()
    for access in (Access(bearer_token=LONG_TOKEN, headers=(("X-Scope-OrgID", TAB_TENANT),)),
                   Access(basic_auth=("planner", TAB_PASSWORD), headers=(("X-Scope-OrgID", TAB_TENANT),))):
        for pad in (0, 120, 150, 185, 195, 230):
            with pytest.raises(FleetError) as raised:
                PrometheusClient(f"{echoing_gate}/{mode}/{pad}", access=access).query("up")
            message = str(raised.value)
            _no_piece(message, LONG_TOKEN, TAB_TENANT, TAB_PASSWORD, basic)
            assert ("HTTP 302" if mode == "redirect" else "HTTP 40") in message
            assert "\t" not in message
            if pad == 0:
                assert "<redacted>" in message, message
    # Through the command: the token from its file, the password from the environment, the header.
    token_file = tmp_path / "token"
    token_file.write_text(LONG_TOKEN + "\n")
    url = f"{echoing_gate}/{mode}/150"
    for done in (_cli("--prometheus", url, "--prometheus.bearer-token-file", str(token_file),
                      "--prometheus.header", f"X-Scope-OrgID:{TAB_TENANT}"),
                 _cli("--prometheus", url, "--prometheus.basic-auth-user", "planner", "--prometheus.header",
                      f"X-Scope-OrgID:{TAB_TENANT}", env={PASSWORD_ENV: TAB_PASSWORD})):
        _no_piece(_fails(done, 3) + done.stdout, LONG_TOKEN, TAB_TENANT, TAB_PASSWORD, basic)


def test_fleet_follows_no_redirect_so_credentials_never_go_elsewhere(tmp_path):
    """A redirect to another host: urllib would resend the Authorization header there. fleet
    stops, says where it points, and the other host sees nothing."""
    caught: list[dict] = []

    class Catcher(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            caught.append(dict(self.headers))
            self.send_response(200)
            self.end_headers()

        do_GET = do_POST

        def log_message(self, *args):
            pass

    with ExitStack() as stack:
        elsewhere = http.server.ThreadingHTTPServer((HOST, 0), Catcher)
        threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
        stack.callback(elsewhere.server_close)
        stack.callback(elsewhere.shutdown)
        target = f"http://{HOST}:{elsewhere.server_address[1]}/login?next=%2F"

        class Redirect(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(302)
                self.send_header("Location", target)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        here = http.server.ThreadingHTTPServer((HOST, 0), Redirect)
        threading.Thread(target=here.serve_forever, daemon=True).start()
        stack.callback(here.server_close)
        stack.callback(here.shutdown)
        token = tmp_path / "token"
        token.write_text(TOKEN)
        done = _cli("--prometheus", f"http://{HOST}:{here.server_address[1]}", "--prometheus.bearer-token-file",
                    str(token))
        stderr = _fails(done, 3)
        assert "HTTP 302" in stderr and f"a redirect to http://{HOST}:{elsewhere.server_address[1]}/login;" in stderr
        assert caught == []


# --- (e) nodes not reporting -------------------------------------------------------------------


def test_a_killed_exporter_is_listed_as_not_reporting_and_none_of_its_devices_is_free(fake_nvidia_smi, tmp_path):
    """Two nodes with a free 3g.40gb; one exporter is killed. Once the rules no longer count it as
    reporting (in a plain Prometheus at the staleness marker of its first failed scrape; behind
    federation, where none comes, after the freshness window), fleet names it as not reporting
    and counts its devices of then unknown, none free."""
    with fleet_nodes(fake_nvidia_smi, tmp_path, "a", "a2") as nodes, \
            real_prometheus(tmp_path, [n.address for n in nodes.values()]) as prom:
        both = {THREE_G: (2, 2, 0, 0), TWO_G: (2, 0, 2, 0), ONE_G: (2, 2, 0, 0), WHOLE: (2, 0, 2, 0)}
        _until(prom.url, both)
        _stop(nodes["a2"].process)
        # Its four devices of then are still counted, as unknown: never free.
        after = {THREE_G: (2, 1, 0, 1), TWO_G: (2, 0, 1, 1), ONE_G: (2, 1, 0, 1), WHOLE: (2, 0, 1, 1)}
        _until(prom.url, after, device_class=THREE_G)
        answer = _answers(_cli("--prometheus", prom.url, "--class", THREE_G, "--devices", "--output", "json"))
        assert _by_class(answer) == after
        assert answer["not_reporting"] == [{"instance": nodes["a2"].address, "labels": {"job": JOB}}]
        assert [n["instance"] for n in answer["nodes"]] == [nodes["a"].address]
        assert {d["instance"] for d in answer["devices"]} == {nodes["a"].address}
        # The same with the window a Prometheus behind federation would be given (--capacity.fresh-within).
        text = _cli("--prometheus", prom.url, "--class", THREE_G, "--capacity.fresh-within", "30s").stdout
        assert f"Nodes not reporting (seen within 1h, not now): {nodes['a2'].address}\n" in text
        assert f"  {nodes['a'].address}  1 free" in text and f"  {nodes['a2'].address}  1 free" not in text


def test_the_freshness_window_is_the_rules_parameter_and_nothing_else():
    """--capacity.fresh-within puts its window where capacity_rules has FRESH_WITHIN, as the
    chart's prometheusRule.capacityFreshWithin does to the rules file; only a duration is taken."""
    queries = QUERIES.fresh_within("45s")
    for expression in (queries.devices, queries.free, queries.in_use, queries.unknown, queries.memory_free,
                       queries.not_reporting, queries.free_devices(THREE_G)):
        assert "[1m]" not in expression and "[45s]" in expression
    assert QUERIES.fresh_within("1m").free == QUERIES.free
    for bad in ("1m] or vector(1) #", "0s", "90", "1d"):
        assert "give a Prometheus duration" in _fails(_cli("--prometheus", "http://127.0.0.1:9",
                                                           "--capacity.fresh-within", bad), 2)


# --- (f) the free devices, as status gives them ------------------------------------------------


def _status_free(node: Node, device_class: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "mig_exporter", "status", "--source", "nvidia-smi", "--nvidia-smi",
                           str(node.smi), "--proc.root", node.proc, "--no-kubernetes", "--output", "json"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    keys = ("device", "index", "uuid", "gpu_instance", "compute_instance", "memory_free_bytes")
    return [{k: d[k] for k in keys} for d in json.loads(done.stdout)["devices"]
            if d["class"] == device_class and d["state"] == "free"]


def test_fleet_lists_the_free_devices_with_the_uuids_and_gpu_instances_status_gives(fake_nvidia_smi, tmp_path):
    """Both nodes named gpu-node-1, one in cluster eu-1 and one in us-1 (a target label, as a
    global Prometheus sees external ones): they stay two nodes, and each free device fleet lists
    is the one status --output json gives on that node, placement index, UUID, GPU instance and
    memory free alike."""
    with fleet_nodes(fake_nvidia_smi, tmp_path, "a", "b") as nodes:
        cluster = {"eu-1": nodes["a"], "us-1": nodes["b"]}
        job = {"job_name": JOB,
               "static_configs": [{"targets": [n.address], "labels": {"cluster": c}} for c, n in cluster.items()],
               "relabel_configs": [{"target_label": "instance", "replacement": "gpu-node-1"}]}
        with real_prometheus(tmp_path, [], job=job) as prom:
            _until(prom.url, BOTH)
            for device_class, on in ((ONE_G, ("eu-1", "us-1")), (THREE_G, ("eu-1",))):
                answer = _answers(_cli("--prometheus", prom.url, "--class", device_class, "--devices",
                                       "--output", "json"))
                assert [(n["instance"], n["labels"]) for n in answer["nodes"]] == [
                    ("gpu-node-1", {"cluster": c, "job": JOB}) for c in on]
                listed = answer["devices"]
                assert [(d["instance"], d["labels"]["cluster"]) for d in listed] == [("gpu-node-1", c) for c in on]
                for c in on:
                    mine = [{k: v for k, v in d.items() if k not in ("instance", "labels")}
                            for d in listed if d["labels"]["cluster"] == c]
                    assert mine == _status_free(cluster[c], device_class), c
                    assert all(d["uuid"].startswith("MIG-") and isinstance(d["gpu_instance"], int) for d in mine)
            text = _cli("--prometheus", prom.url, "--class", ONE_G)
            assert '  gpu-node-1 {cluster="eu-1"}  1 free\n  gpu-node-1 {cluster="us-1"}  1 free\n' in text.stdout
            text = _cli("--prometheus", prom.url, "--class", THREE_G, "--devices")
            assert text.returncode == 0, text.stderr
            assert f"Free {THREE_G} devices now:" in text.stdout
            assert re.search(r'^  gpu-node-1 \{cluster="eu-1"\}\s+0/mig0\s+MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b'
                             r"\s+2\s+39\.2 GiB$", text.stdout, re.M), text.stdout
