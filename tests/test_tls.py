"""HTTPS, client certificates and basic auth on a real server on 127.0.0.1, with real ``ssl`` and
``http.client`` clients and certificates made in the test."""

from __future__ import annotations

import base64
import http.client
import logging
import shutil
import socket
import ssl
import threading
import time

import bcrypt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from certs import Pair, make_pki, make_server_pair
from mig_exporter.metrics.exporter import Exporter
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.demo import DemoSource
from mig_exporter.web.server import ExporterServer
from mig_exporter.web.webconfig import WebSettings

pytestmark = pytest.mark.timeout(60)

PASSWORD = "correct horse"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def serve_web(tmp_path):
    """Start a server with the given web config text; return (host, port)."""
    servers = []

    def start(text: str) -> tuple[str, int]:
        web = tmp_path / f"web-{len(servers)}.yml"
        web.write_text(text)
        server = ExporterServer(("127.0.0.1", 0), Exporter(Scraper(DemoSource()), timeout_s=5),
                                web=WebSettings(str(web), check_interval_s=0))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[:2]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def tls_config(pki, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n{extra}"


def client_context(pki, cert: Pair | None = None, **versions) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    if cert is not None:
        context.load_cert_chain(cert.cert, cert.key)
    for name, version in versions.items():
        setattr(context, name, version)
    return context


def https_get(address, context: ssl.SSLContext, path: str = "/metrics", headers: dict[str, str] | None = None):
    conn = http.client.HTTPSConnection(*address, context=context, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        conn.close()


def refused(address, context: ssl.SSLContext) -> BaseException:
    """The error a client gets when the server refuses its handshake. In TLS 1.3 the client may only
    learn it when it reads the answer."""
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)) as raised:
        https_get(address, context)
    return raised.value


def read_success(body: bytes) -> float | None:
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == "mig_exporter_read_success":
                return s.value
    return None


def warnings_matching(caplog, text: str, within_s: float = 3.0) -> list[str]:
    """The warnings holding ``text``, waiting briefly for the first: the server's thread may log
    a refused handshake a moment after the client has seen it fail."""
    deadline = time.monotonic() + within_s
    while True:
        found = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


# --- TLS -----------------------------------------------------------------------------------------

def test_metrics_over_https_with_a_certificate_made_in_the_test(pki, serve_web):
    address = serve_web(tls_config(pki))
    status, _, body = https_get(address, client_context(pki))
    assert status == 200 and read_success(body) == 1
    conn = socket.create_connection(address)
    with client_context(pki).wrap_socket(conn, server_hostname="127.0.0.1") as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
        assert dict(x[0] for x in tls.getpeercert()["subject"])["commonName"] == "127.0.0.1"


def test_a_client_that_does_not_trust_the_certificate_fails_and_the_server_carries_on(pki, serve_web, capfd):
    address = serve_web(tls_config(pki))
    with pytest.raises(ssl.SSLCertVerificationError):
        https_get(address, ssl.create_default_context())  # the system's roots do not know our CA
    assert https_get(address, client_context(pki))[0] == 200
    assert "Traceback" not in capfd.readouterr().err


def test_plain_http_on_the_https_port_gets_a_400_that_says_so(pki, serve_web, caplog):
    address = serve_web(tls_config(pki))
    conn = http.client.HTTPConnection(*address, timeout=10)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert (response.status, response.read()) == (400, b"Client sent an HTTP request to an HTTPS server.\n")
    assert len(warnings_matching(caplog, "plain HTTP sent to the HTTPS port")) == 1


def test_a_client_that_never_finishes_its_handshake_holds_up_no_one(pki, serve_web):
    address = serve_web(tls_config(pki))
    stalled = [socket.create_connection(address) for _ in range(5)]
    stalled[0].sendall(b"\x16\x03\x01")  # the start of a ClientHello, and then nothing
    try:
        started = time.monotonic()
        assert https_get(address, client_context(pki))[0] == 200
        assert time.monotonic() - started < 5
    finally:
        for s in stalled:
            s.close()


def test_min_version_tls13_refuses_a_tls12_client(pki, serve_web, caplog):
    address = serve_web(tls_config(pki, "  min_version: TLS13\n"))
    refused(address, client_context(pki, maximum_version=ssl.TLSVersion.TLSv1_2))
    assert https_get(address, client_context(pki, minimum_version=ssl.TLSVersion.TLSv1_3))[0] == 200
    [line] = warnings_matching(caplog, "TLS handshake with 127.0.0.1:")
    assert "unsupported protocol (min_version TLS13," in line


def test_a_rotated_certificate_is_served_from_a_later_connection(pki, serve_web, tmp_path):
    """The event loop never waits for the web config's check: the connection that finds it due is
    served the certificate in force, and a connection after the check the rotated one."""
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(pki.server.cert, cert)
    shutil.copy(pki.server.key, key)
    address = serve_web(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")

    def served_common_name() -> str:
        with client_context(pki).wrap_socket(socket.create_connection(address), server_hostname="127.0.0.1") as tls:
            return dict(x[0] for x in tls.getpeercert()["subject"])["commonName"]

    assert served_common_name() == "127.0.0.1"
    rotated = make_server_pair(tmp_path / "new", "rotated", pki.ca, "rotated.example")
    shutil.copy(rotated.cert, cert)
    shutil.copy(rotated.key, key)
    deadline = time.monotonic() + 10
    names = [served_common_name()]
    while names[-1] != "rotated.example" and time.monotonic() < deadline:
        time.sleep(0.05)
        names.append(served_common_name())
    assert names[-1] == "rotated.example"
    assert set(names) <= {"127.0.0.1", "rotated.example"}


# --- client certificates (mTLS) ------------------------------------------------------------------

def mtls(pki, auth_type: str, extra: str = "") -> str:
    return tls_config(pki, f"  client_auth_type: {auth_type}\n  client_ca_file: {pki.ca.cert}\n{extra}")


def test_mtls_required_admits_a_client_with_a_certificate_from_the_ca(pki, serve_web):
    address = serve_web(mtls(pki, "RequireAndVerifyClientCert"))
    status, _, body = https_get(address, client_context(pki, pki.client))
    assert status == 200 and read_success(body) == 1


def test_mtls_required_refuses_a_client_without_a_certificate(pki, serve_web, caplog, capfd):
    address = serve_web(mtls(pki, "RequireAndVerifyClientCert"))
    refused(address, client_context(pki))
    [line] = warnings_matching(caplog, "TLS handshake with 127.0.0.1:")
    assert "certificate" in line and "RequireAndVerifyClientCert" in line
    assert https_get(address, client_context(pki, pki.client))[0] == 200, "the server carries on"
    assert "Traceback" not in capfd.readouterr().err


def test_mtls_required_refuses_a_certificate_no_configured_ca_signed(pki, serve_web, caplog):
    address = serve_web(mtls(pki, "RequireAndVerifyClientCert"))
    refused(address, client_context(pki, pki.stranger))
    [line] = warnings_matching(caplog, "TLS handshake with 127.0.0.1:")
    assert "client certificate not verified" in line


def test_verify_client_cert_if_given_admits_none_but_not_a_bad_one(pki, serve_web):
    address = serve_web(mtls(pki, "VerifyClientCertIfGiven"))
    assert https_get(address, client_context(pki))[0] == 200
    assert https_get(address, client_context(pki, pki.client))[0] == 200
    refused(address, client_context(pki, pki.stranger))


def test_client_allowed_sans_admit_only_the_named_client(pki, serve_web, caplog):
    address = serve_web(mtls(pki, "RequireAndVerifyClientCert", "  client_allowed_sans: [prometheus]\n"))
    assert https_get(address, client_context(pki, pki.client))[0] == 200
    refused(address, client_context(pki, pki.other_client))
    [line] = warnings_matching(caplog, "refused")
    assert "['intruder'] match none of client_allowed_sans" in line


# --- basic auth -------------------------------------------------------------------------------------

def test_basic_auth_over_tls_good_wrong_and_missing_credentials(pki, serve_web, caplog):
    address = serve_web(tls_config(pki, f"basic_auth_users:\n  prometheus: {HASH}\n"))
    context = client_context(pki)

    status, headers, body = https_get(address, context)
    assert (status, headers["WWW-Authenticate"], body) == (401, 'Basic realm="mig-exporter"', b"Unauthorized\n")
    status, _, body = https_get(address, context, headers=basic("prometheus", "wrong"))
    assert status == 401 and b"mig_exporter" not in body
    assert https_get(address, context, headers=basic("mallory", PASSWORD))[0] == 401
    status, _, body = https_get(address, context, headers=basic("prometheus", PASSWORD))
    assert status == 200 and read_success(body) == 1

    lines = warnings_matching(caplog, "answered 401")
    assert [line.split("answered 401: ")[1] for line in lines] == [
        "no credentials", "wrong password for user 'prometheus'", "unknown user 'mallory'"]
    assert not any("wrong" in r.getMessage() and PASSWORD in r.getMessage() for r in caplog.records)


def test_basic_auth_guards_every_path_as_the_exporter_toolkit_does(pki, serve_web):
    address = serve_web(tls_config(pki, f"basic_auth_users:\n  prometheus: {HASH}\n"))
    context = client_context(pki)
    for path in ("/", "/-/healthy", "/-/ready", "/nope"):
        assert https_get(address, context, path)[0] == 401, path
    assert https_get(address, context, "/-/healthy", basic("prometheus", PASSWORD))[0] == 200


def test_basic_auth_without_tls(tmp_path, serve_web):
    address = serve_web(f"basic_auth_users:\n  prometheus: {HASH}\n")
    conn = http.client.HTTPConnection(*address, timeout=10)
    conn.request("GET", "/metrics")
    assert conn.getresponse().status == 401
    conn.close()
    conn = http.client.HTTPConnection(*address, timeout=10)
    conn.request("GET", "/metrics", headers=basic("prometheus", PASSWORD))
    assert conn.getresponse().status == 200


def test_headers_and_rate_limit_from_the_web_config(pki, serve_web, caplog):
    address = serve_web(tls_config(pki, "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
                                        "    Strict-Transport-Security: max-age=31536000\n"
                                        "rate_limit:\n  interval: 1m\n  burst: 2\n"))
    context = client_context(pki)
    first = https_get(address, context, "/-/healthy")
    assert first[0] == 200
    assert first[1]["X-Content-Type-Options"] == "nosniff"
    assert first[1]["Strict-Transport-Security"] == "max-age=31536000"
    assert https_get(address, context, "/-/healthy")[0] == 200
    assert https_get(address, context, "/-/healthy")[0] == 429
    assert len(warnings_matching(caplog, "answered 429")) == 1


def test_failed_guesses_are_counted_against_the_peer_that_sent_them(tmp_path):
    # The handler hands the client's address to basic auth, whose fair queue puts a guessing
    # peer's checks behind everyone else's first tries (tests/test_webconfig.py).
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: {HASH}\n")
    server = ExporterServer(("127.0.0.1", 0), Exporter(Scraper(DemoSource()), timeout_s=5),
                            web=WebSettings(str(web), check_interval_s=0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host, port = server.server_address[:2]
        guesser = http.client.HTTPConnection(host, port, timeout=10, source_address=("127.0.0.2", 0))
        for i in range(3):
            guesser.request("GET", "/metrics", headers=basic("prometheus", f"guess-{i}"))
            response = guesser.getresponse()
            response.read()
            assert response.status == 401
        guesser.close()
        scraper = http.client.HTTPConnection(host, port, timeout=10)
        scraper.request("GET", "/metrics", headers=basic("prometheus", PASSWORD))
        assert scraper.getresponse().status == 200
        scraper.close()
        auth = server.web_config().auth
        assert auth is not None
        assert (auth._gate.failures("127.0.0.2"), auth._gate.failures("127.0.0.1")) == (3, 0)
    finally:
        server.shutdown()
        server.server_close()
