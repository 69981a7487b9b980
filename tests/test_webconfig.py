"""The web config file in exporter-toolkit's format: what it accepts, every error at once, basic auth
with its bcrypt cache, the rate limit, and reloading when the file or a certificate changes."""

from __future__ import annotations

import base64
import os
import ssl
import threading
import time

import bcrypt
import pytest

from certs import make_pki
from mig_exporter.config.checks import ConfigError
from mig_exporter.web.basic_auth import AUTH_BCRYPT_SLOTS, AUTH_FAILED_CACHE_SIZE, BasicAuth, _peer_group
from mig_exporter.web.rate_limit import TokenBucket
from mig_exporter.web.webconfig import WebSettings, load_web_config, parse_web_config

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def errors_of(text: str, base_dir: str = ".") -> list[str]:
    with pytest.raises(ConfigError) as raised:
        parse_web_config(text, "web.yml", base_dir)
    return list(raised.value.errors)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


# --- loading -----------------------------------------------------------------------------------

def test_an_empty_file_means_plain_http_without_auth():
    config = parse_web_config("", "web.yml")
    assert (config.tls, config.ssl_context, config.auth, config.users) == (None, None, None, ())
    assert config.summary() == "no TLS; no basic auth"


def test_the_toolkit_sample_shape_loads_with_relative_paths_beside_the_file(pki, tmp_path):
    web = tmp_path / "web.yml"
    os.symlink(pki.server.cert, tmp_path / "server.crt")
    os.symlink(pki.server.key, tmp_path / "server.key")
    web.write_text(
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        f"basic_auth_users:\n  alice: {HASH}\n  bob: '{HASH.replace('$2b$', '$2y$')}'\n"
        "http_server_config:\n  http2: false\n  headers:\n    X-Frame-Options: deny\n"
        "rate_limit:\n  interval: 1s\n  burst: 20\n"
    )
    config = load_web_config(web)
    assert config.tls is not None and config.tls.cert_file == str(tmp_path / "server.crt")
    assert isinstance(config.ssl_context, ssl.SSLContext)
    assert config.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert config.ssl_context.verify_mode == ssl.CERT_NONE
    assert config.users == ("alice", "bob")
    assert dict(config.headers) == {"X-Frame-Options": "deny"}
    assert config.http2 is False
    assert config.summary() == ("TLS (TLS12+, client certificates: NoClientCert); basic auth: 2 users; "
                                "rate limit: 1 per 1s, burst 20")


@pytest.mark.parametrize("auth_type, mode", [
    ("RequireAndVerifyClientCert", ssl.CERT_REQUIRED),
    ("VerifyClientCertIfGiven", ssl.CERT_OPTIONAL),
    ("RequireAnyClientCert", ssl.CERT_REQUIRED),
    ("RequestClientCert", ssl.CERT_NONE),
])
def test_client_auth_types_map_to_python_verify_modes(pki, auth_type, mode):
    config = parse_web_config(
        f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
        f"  client_ca_file: {pki.ca.cert}\n  client_auth_type: {auth_type}\n  min_version: TLS13\n", "web.yml")
    assert config.ssl_context.verify_mode == mode
    assert config.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_3


def test_inline_certificate_and_key_load_like_files(pki):
    indent = "\n    "
    text = (f"tls_server_config:\n  cert: |{indent}{indent.join(pki.server.cert.read_text().splitlines())}\n"
            f"  key: |{indent}{indent.join(pki.server.key.read_text().splitlines())}\n")
    assert isinstance(parse_web_config(text, "web.yml").ssl_context, ssl.SSLContext)


def test_every_error_is_reported_at_once(tmp_path):
    errors = errors_of(
        "tls_server_config:\n"
        "  cert_file: missing.crt\n"
        "  client_auth_type: RequireAndVerifyClientCrt\n"
        "  min_version: TLS14\n"
        "  cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]\n"
        "  curve_preferences: [CurveP999]\n"
        "basic_auth_users:\n"
        "  alice: hunter2\n"
        f"  bob: $2y$03${HASH[7:]}\n"
        "http_server_config:\n  headers:\n    X-Powered-By: me\n    X-Frame-Options: allow\n"
        "rate_limit:\n  interval: 1s\n  burst: 0\n"
        "auth_excluded_paths: [/-/healthy]\n",
        str(tmp_path),
    )
    assert errors == [
        "auth_excluded_paths: unknown key (known: tls_server_config, http_server_config, basic_auth_users, "
        "rate_limit)",
        "tls_server_config: missing one of key or key_file",
        "tls_server_config.client_auth_type: unknown value RequireAndVerifyClientCrt (known: NoClientCert, "
        "RequestClientCert, RequireAnyClientCert, RequireClientCert, VerifyClientCertIfGiven, "
        "RequireAndVerifyClientCert)",
        "tls_server_config.min_version: unknown value TLS14 (known: TLS10, TLS11, TLS12, TLS13)",
        "tls_server_config.cipher_suites[0]: unknown cipher suite TLS_RSA_WITH_RC4_128_SHA (Go's names, e.g. "
        "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)",
        "tls_server_config.curve_preferences[0]: unknown curve CurveP999 (known: CurveP256, CurveP384, CurveP521, "
        "X25519)",
        "basic_auth_users.alice: not a bcrypt hash ($2y$, $2b$ or $2a$ and 56 more characters; make one with: "
        "htpasswd -nBC 10 \"\" | tr -d ':\\n')",
        "basic_auth_users.bob: bcrypt cost 3 is out of range (4 to 31)",
        "http_server_config.headers.X-Powered-By: this header cannot be set (known: Strict-Transport-Security, "
        "X-Content-Type-Options, X-Frame-Options, X-XSS-Protection, Content-Security-Policy)",
        "http_server_config.headers.X-Frame-Options: unknown value allow (known: deny, sameorigin)",
        "rate_limit.burst: must be at least 1 when interval is set (0 would refuse every request)",
    ]


def test_files_that_do_not_load_are_reported_at_start(pki, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    assert errors_of(f"tls_server_config:\n  cert_file: {tmp_path}/nope.crt\n  key_file: {pki.server.key}\n") == [
        f"tls_server_config.cert_file: no such file: '{tmp_path}/nope.crt'"]
    [mismatch] = errors_of(f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.client.key}\n")
    assert mismatch.startswith("tls_server_config: cannot load the certificate and key (")
    assert "is the key the certificate's?" in mismatch
    [bad_ca] = errors_of(f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
                         f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {not_pem}\n")
    assert bad_ca.startswith("tls_server_config.client_ca_file: cannot load (")


@pytest.mark.parametrize("text, error", [
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_ca_file: c\n",
     "tls_server_config.client_ca_file: set, but client_auth_type is NoClientCert, so no client certificate "
     "would be checked; set client_auth_type: RequireAndVerifyClientCert"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: RequireAnyClientCert\n",
     "tls_server_config.client_auth_type: RequireAnyClientCert needs client_ca_file here: Python's ssl cannot "
     "require a client certificate without verifying it (use RequireAndVerifyClientCert with client_ca_file)"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_allowed_sans: [prometheus]\n",
     "tls_server_config.client_allowed_sans: needs client_auth_type RequireAnyClientCert or "
     "RequireAndVerifyClientCert (with any other, a client may send no certificate)"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  min_version: TLS13\n  max_version: TLS12\n",
     "tls_server_config: min_version TLS13 is above max_version TLS12"),
    ("tls_server_config:\n  cert_file: a\n  cert: b\n  key_file: c\n",
     "tls_server_config: give cert or cert_file, not both"),
    ("- just a list\n", "the file must be a mapping of settings, not a list (known: tls_server_config, "
     "http_server_config, basic_auth_users, rate_limit)"),
    ("basic_auth_users: [alice]\n",
     "basic_auth_users: must be a mapping of user names to bcrypt hashes, not a list"),
    ("tls_server_config: {cert_file: a, key_file: b}\ntls_server_config: {}\n",
     "tls_server_config: given twice (first on line 1, again on line 2)"),
    ("basic_auth_users: {alice: [\n", None),
])
def test_one_clear_error_per_mistake(text, error):
    errors = errors_of(text)
    if error is None:
        assert len(errors) == 1 and errors[0].startswith("line ") and "not valid YAML" in errors[0]
    else:
        assert error in errors


def test_tls_settings_alone_without_a_certificate_mean_no_tls():
    # The toolkit turns TLS on only when a certificate, key, CA or client auth type is given.
    assert parse_web_config("tls_server_config:\n  min_version: TLS13\n", "web.yml").tls is None


# --- basic auth --------------------------------------------------------------------------------

class CountingBcrypt:
    """Real bcrypt, counted."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        with self.lock:
            self.calls += 1
        return bcrypt.checkpw(password, hashed)


def test_good_wrong_and_missing_credentials():
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert auth.check(basic("prometheus", "s3cret")).ok
    assert auth.check(basic("prometheus", "wrong")).reason == "wrong password for user 'prometheus'"
    assert auth.check(basic("mallory", "s3cret")).reason == "unknown user 'mallory'"
    assert auth.check(None).reason == "no credentials"
    assert auth.check("Bearer abc").reason == "'Bearer' credentials, not Basic"
    assert auth.check("Basic !!!").reason == "Basic credentials that are not valid base64"
    assert auth.check("Basic " + base64.b64encode(b"no-colon").decode()).reason == (
        "Basic credentials without a ':' between user and password")
    assert not any(auth.check(basic("prometheus", p)).ok for p in ("", "s3cret ", "S3cret", "s3cre"))


def test_a_password_may_hold_colons_and_any_utf8():
    hashed = bcrypt.hashpw("a:b:ç€".encode(), bcrypt.gensalt(rounds=4))
    auth = BasicAuth({"ü": hashed})
    assert auth.check(basic("ü", "a:b:ç€")).ok


def test_passwords_past_72_bytes_compare_on_their_first_72_as_bcrypt_does():
    long_password = "x" * 72
    auth = BasicAuth({"p": bcrypt.hashpw(long_password.encode(), bcrypt.gensalt(rounds=4))})
    assert auth.check(basic("p", long_password + "ignored")).ok  # no ValueError from bcrypt 5
    assert not auth.check(basic("p", "x" * 71)).ok


def test_verification_is_cached_per_user_and_password():
    counting = CountingBcrypt()
    auth = BasicAuth({"prometheus": HASH.encode(), "grafana": HASH.encode()}, verify=counting)
    for _ in range(100):
        assert auth.check(basic("prometheus", "s3cret")).ok
    assert counting.calls == 1, "a scrape must not pay bcrypt each time"
    assert not auth.check(basic("prometheus", "wrong")).ok
    assert not auth.check(basic("prometheus", "wrong")).ok
    assert counting.calls == 2, "a wrong password is cached too: a stale secret hammering costs one check"
    assert auth.check(basic("grafana", "s3cret")).ok
    assert counting.calls == 3, "the cache is keyed on the user as well as the password"


def test_concurrent_first_scrapes_verify_once():
    counting = CountingBcrypt()
    auth = BasicAuth({"prometheus": HASH.encode()}, verify=counting)
    results = []
    threads = [threading.Thread(target=lambda: results.append(auth.check(basic("prometheus", "s3cret")).ok))
               for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 20 and counting.calls == 1


class FakeBcrypt:
    """bcrypt's contract without its cost: a hash in ``plain`` matches the password it was made
    for, anything else (a decoy) matches nothing. Records each call's password and cost; a call
    for a password in ``block`` waits for ``release``."""

    def __init__(self, plain: dict[bytes, bytes], block: tuple[bytes, ...] = ()) -> None:
        self.plain = plain
        self.block = block
        self.calls: list[tuple[bytes, int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        with self.lock:
            self.calls.append((password, int(hashed[4:6])))
        if password in self.block:
            self.entered.set()
            assert self.release.wait(10), "the test never released the blocked check"
        return self.plain.get(hashed) == password

    def passwords(self) -> list[bytes]:
        with self.lock:
            return [password for password, _ in self.calls]


def until(condition, what: str, limit_s: float = 10.0) -> None:
    """Wait, bounded, for another thread to get somewhere."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def started(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_a_flood_of_wrong_passwords_never_evicts_a_verified_credential():
    fake = FakeBcrypt({HASH.encode(): b"s3cret"})
    auth = BasicAuth({"prometheus": HASH.encode()}, verify=fake)
    assert auth.check(basic("prometheus", "s3cret"), peer=("10.0.0.7", 40000)).ok
    guesses_each, peers = 1000, 4

    def guess(n: int) -> None:
        for i in range(guesses_each):
            assert not auth.check(basic("prometheus", f"guess-{n}-{i}"), peer=(f"10.0.0.{66 + n}", 50000 + i)).ok

    threads = [started(guess, n) for n in range(peers)]
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(fake.calls) == 1 + guesses_each * peers, "every distinct guess paid its check"
    assert len(auth._verified) == 1 and len(auth._failed) == AUTH_FAILED_CACHE_SIZE
    before = len(fake.calls)
    for _ in range(100):
        assert auth.check(basic("prometheus", "s3cret"), peer=("10.0.0.7", 40001)).ok
    assert len(fake.calls) == before, "the verified credential is still cached: no bcrypt after the flood"


def test_only_verified_pairs_can_push_a_verified_pair_out():
    hashes = {f"user{i}": bcrypt.hashpw(f"pw{i}".encode(), bcrypt.gensalt(rounds=4)) for i in range(4)}
    fake = FakeBcrypt({h: f"pw{i}".encode() for i, h in enumerate(hashes.values())})
    auth = BasicAuth(hashes, cache_size=3, verify=fake)
    for i in range(3):
        assert auth.check(basic(f"user{i}", f"pw{i}")).ok
    assert auth.check(basic("user0", "pw0")).ok  # user0 is now the most recently used
    assert len(fake.calls) == 3
    for i in range(AUTH_FAILED_CACHE_SIZE * 3):
        auth.check(basic("user1", f"guess-{i}"))
    assert {user for user, _ in auth._verified} == {b"user0", b"user1", b"user2"}
    assert auth.check(basic("user3", "pw3")).ok  # a fourth verified pair: the least recently used goes
    assert {user for user, _ in auth._verified} == {b"user0", b"user2", b"user3"}
    calls = len(fake.calls)
    assert auth.check(basic("user1", "pw1")).ok and len(fake.calls) == calls + 1


def test_the_cache_holds_no_password():
    auth = BasicAuth({"prometheus": HASH.encode()})
    auth.check(basic("prometheus", "s3cret"))
    auth.check(basic("prometheus", "wrong"))
    ((user, digest),) = auth._verified
    assert user == b"prometheus" and b"s3cret" not in digest and len(digest) == 32
    ((_, wrong_digest),) = auth._failed
    assert b"wrong" not in wrong_digest and len(wrong_digest) == 32


def test_a_cached_credential_never_waits_for_a_check_in_flight():
    fake = FakeBcrypt({HASH.encode(): b"s3cret"}, block=(b"guess",))
    auth = BasicAuth({"prometheus": HASH.encode()}, verify=fake)
    assert auth.check(basic("prometheus", "s3cret"), peer=("10.0.0.7", 1)).ok
    guess = started(auth.check, basic("prometheus", "guess"), ("10.0.0.66", 2))
    assert fake.entered.wait(10)
    results: list[bool] = []
    scrape = started(lambda: results.append(auth.check(basic("prometheus", "s3cret"), peer=("10.0.0.7", 3)).ok))
    scrape.join(10)
    alive = scrape.is_alive()
    fake.release.set()
    guess.join(10)
    assert not alive and results == [True], "a cached credential waited for a bcrypt check in flight"
    assert fake.passwords() == [b"s3cret", b"guess"]


def test_a_peer_that_has_not_failed_is_checked_before_a_guessing_peers_queue():
    fake = FakeBcrypt({HASH.encode(): b"s3cret"}, block=(b"blocker",))
    auth = BasicAuth({"prometheus": HASH.encode()}, verify=fake)
    attacker, scraper = ("10.0.0.66", 1), ("10.0.0.7", 2)
    for i in range(3):
        assert not auth.check(basic("prometheus", f"early-{i}"), peer=attacker).ok
    assert auth._gate.failures("10.0.0.66") == 3
    threads = [started(auth.check, basic("prometheus", "blocker"), attacker)]
    assert fake.entered.wait(10)
    threads += [started(auth.check, basic("prometheus", f"queued-{i}"), attacker) for i in range(5)]
    until(lambda: auth._gate.waiting() == 5, "the guesses to queue")
    results: list[bool] = []
    threads.append(started(lambda: results.append(auth.check(basic("prometheus", "s3cret"), peer=scraper).ok)))
    until(lambda: auth._gate.waiting() == 6, "the scraper to queue")
    fake.release.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads) and results == [True]
    order = fake.passwords()
    assert order[:5] == [b"early-0", b"early-1", b"early-2", b"blocker", b"s3cret"], (
        "the scraper's first check waited behind the guesses queued before it")
    assert sorted(order[5:]) == [f"queued-{i}".encode() for i in range(5)]
    assert auth._gate.failures("10.0.0.66") == 9 and auth._gate.failures("10.0.0.7") == 0


def test_checks_from_one_peer_share_one_bcrypt_slot_and_hand_it_on():
    # Guesses from one peer run one after another; every one is answered, none is lost in the queue.
    fake = FakeBcrypt({HASH.encode(): b"s3cret"})
    auth = BasicAuth({"prometheus": HASH.encode()}, verify=fake)
    outcomes: list[bool] = []
    lock = threading.Lock()

    def guess(i: int) -> None:
        ok = auth.check(basic("prometheus", "s3cret" if i == 25 else f"g{i}"), peer=("10.0.0.66", i)).ok
        with lock:
            outcomes.append(ok)

    threads = [started(guess, i) for i in range(50)]
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert sorted(outcomes) == [False] * 49 + [True] and len(fake.calls) == 50
    assert auth._gate.waiting() == 0 and auth._gate._free == AUTH_BCRYPT_SLOTS


@pytest.mark.parametrize("peer, group", [
    (("127.0.0.1", 5000), "127.0.0.1"),
    (("::ffff:10.1.2.3", 5000, 0, 0), "10.1.2.3"),
    (("2001:db8:1:2::1", 5000, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:2:ffff:ffff:ffff:ffff", 5000, 0, 0), "2001:db8:1:2::/64"),
    (("fe80::1%eth0", 5000, 0, 2), "fe80::/64"),
    ("10.0.0.1", "10.0.0.1"),
    (None, ""),
    ("/run/socket", "/run/socket"),
])
def test_peers_are_counted_by_host_and_ipv6_by_slash_64(peer, group):
    assert _peer_group(peer) == group


# Two users of different costs: the check must take the same work whoever is named.
LOW = bcrypt.hashpw(b"low-secret", bcrypt.gensalt(rounds=4))
HIGH = bcrypt.hashpw(b"high-secret", bcrypt.gensalt(rounds=6))


class RecordingBcrypt:
    """Real bcrypt; records the cost of each hash checked and whether it was a configured user's."""

    def __init__(self, users: tuple[bytes, ...]) -> None:
        self.users = users
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.calls.append((int(hashed[4:6]), hashed in self.users))
        return bcrypt.checkpw(password, hashed)


@pytest.mark.parametrize("user, password, ok, own", [
    ("mallory", "x", False, None),      # unknown: decoys at both costs, the highest included
    ("low", "wrong", False, 4),
    ("high", "wrong", False, 6),
    ("low", "low-secret", True, 4),
    ("high", "high-secret", True, 6),
])
def test_every_check_does_the_work_of_every_configured_cost(user, password, ok, own):
    recording = RecordingBcrypt((LOW, HIGH))
    auth = BasicAuth({"low": LOW, "high": HIGH}, verify=recording)
    assert auth.check(basic(user, password)).ok is ok
    assert [cost for cost, _ in recording.calls] == [4, 6], "the same checks, in the same order, for everyone"
    assert [cost for cost, users in recording.calls if users] == ([own] if own else [])
    if own is None:
        assert (6, False) in recording.calls, "an unknown user pays a check at the highest cost"


def test_the_decoys_match_no_password_and_cost_nothing_to_make(monkeypatch):
    def no_hashing(*_: object) -> bytes:
        raise AssertionError("a decoy was hashed at load: a reload would stall connections")

    monkeypatch.setattr(bcrypt, "hashpw", no_hashing)
    top = "$2b$31$" + HASH[7:]  # cost 31: hashing anything at that cost would take days
    auth = BasicAuth({"a": LOW, "b": top.encode()})
    assert sorted(auth._decoys) == [4, 31]
    decoy = auth._decoys[4]
    monkeypatch.undo()
    assert len(decoy) == 60 and decoy.startswith(b"$2b$04$")
    assert not any(bcrypt.checkpw(p, decoy) for p in (b"", b"x", b"low-secret"))


def test_single_cost_users_pay_one_check():
    counting = CountingBcrypt()
    auth = BasicAuth({"prometheus": HASH.encode(), "grafana": HASH.encode()}, verify=counting)
    assert not auth.check(basic("mallory", "x")).ok
    assert counting.calls == 1


# --- rate limit --------------------------------------------------------------------------------

def test_token_bucket_allows_bursts_then_one_per_interval():
    now = [0.0]
    bucket = TokenBucket(1.0, 3, clock=lambda: now[0])
    assert [bucket.allow() for _ in range(4)] == [True, True, True, False]
    now[0] = 0.5
    assert not bucket.allow()
    now[0] = 1.01
    assert bucket.allow() and not bucket.allow()
    now[0] = 100.0
    assert sum(bucket.allow() for _ in range(10)) == 3


# --- reloading ---------------------------------------------------------------------------------

# The event loop waits for no check (it serves the config in force, and the connections after the
# check what it found: tests/test_reload.py); these tests wait for each check they start.
WAIT_S = 30.0


def test_the_event_loop_is_served_the_config_in_force_while_a_check_runs(tmp_path, monkeypatch):
    import threading

    import mig_exporter.web.webconfig

    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    settings = WebSettings(str(web), check_interval_s=0)
    release = threading.Event()

    def slow_load(path, **options):
        release.wait(WAIT_S)
        return load_web_config(path, **options)

    monkeypatch.setattr(mig_exporter.web.webconfig, "load_web_config", slow_load)
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n  bob: {HASH}\n")
    os.utime(web, ns=(1, 1))
    assert settings.current().users == ("alice",), "no wait: the config in force"
    release.set()
    assert settings.current(WAIT_S).users == ("alice", "bob")
    assert settings.current().users == ("alice", "bob")


def test_a_changed_file_is_reloaded_and_a_bad_change_keeps_the_config_in_force(tmp_path, caplog):
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    settings = WebSettings(str(web), check_interval_s=0)
    assert settings.current(WAIT_S).users == ("alice",)
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n  bob: {HASH}\n")
    os.utime(web, ns=(1, 1))
    assert settings.current(WAIT_S).users == ("alice", "bob")
    web.write_text("basic_auth_users:\n  carol: plaintext\n")
    assert settings.current(WAIT_S).users == ("alice", "bob")
    assert settings.current(WAIT_S).users == ("alice", "bob")
    failures = [r for r in caplog.records if "reloading" in r.getMessage()]
    assert len(failures) == 1, "a bad file is reported once, not at every connection"
    assert "basic_auth_users.carol: not a bcrypt hash" in failures[0].getMessage()


def test_tls_cannot_be_switched_on_by_a_reload(pki, tmp_path):
    web = tmp_path / "web.yml"
    web.write_text("")
    settings = WebSettings(str(web), check_interval_s=0)
    web.write_text(f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n")
    assert settings.current(WAIT_S).tls is None


# --- YAML the web config may not use -----------------------------------------------------------

def test_anchors_and_aliases_are_refused_as_in_the_config_file(tmp_path):
    assert errors_of(f"basic_auth_users:\n  alice: &h {HASH}\n  bob: *h\n") == [
        "line 2, column 10: YAML anchor &h: anchors and aliases are not allowed in this file; "
        "write the value out in full"
    ]
    assert errors_of("tls_server_config:\n  min_version: *v\n") == [
        "line 2, column 16: YAML alias *v: anchors and aliases are not allowed in this file; "
        "write the value out in full"
    ]
    assert errors_of("[" * 100 + "]" * 100) == [
        "line 1, column 33: nested more than 32 levels deep; no setting in this file goes that deep"
    ]
    web = tmp_path / "web.yml"
    web.write_text("# a comment\n" * 100_000)
    with pytest.raises(ConfigError) as raised:
        load_web_config(web)
    assert raised.value.errors == ("larger than 1 MiB; a config file is a few KB (is it the right file?)",)


def test_a_reload_into_an_alias_bomb_keeps_the_config_in_force(tmp_path, caplog):
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    settings = WebSettings(str(web), check_interval_s=0)
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"{n}: &{n} [" + ", ".join([f"*{b}"] * 9) + "]" for n, b in zip("bcdefghi", "abcdefgh", strict=True)]
    web.write_text("bomb:\n" + "".join(f"  {line}\n" for line in lines) + "tls_server_config: {min_version: *i}\n")
    assert settings.current(WAIT_S).users == ("alice",)
    assert settings.current(WAIT_S).users == ("alice",)
    failures = [r for r in caplog.records if "reloading" in r.getMessage()]
    assert len(failures) == 1 and "line 2, column 6: YAML anchor &a" in failures[0].getMessage()


def test_an_unexpected_error_in_a_reload_keeps_the_config_in_force(tmp_path, caplog, monkeypatch):
    import logging

    import mig_exporter.web.webconfig

    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    settings = WebSettings(str(web), check_interval_s=0)

    def broken(path, **options):
        raise RuntimeError("a bug\nin two lines")

    monkeypatch.setattr(mig_exporter.web.webconfig, "load_web_config", broken)
    web.write_text(f"basic_auth_users:\n  bob: {HASH}\n")
    with caplog.at_level(logging.INFO, logger="mig_exporter"):
        assert settings.current(WAIT_S).users == ("alice",)
        assert settings.current(WAIT_S).users == ("alice",)
    failures = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in failures] == [
        f"reloading {web} failed; kept the web config in force: unexpected error: RuntimeError: a bug in two lines"
    ]
    assert failures[0].exc_info is None


# --- a torn web config (issue 38) ----------------------------------------------------------------

def test_a_reload_into_an_empty_web_config_keeps_auth_in_force(tmp_path, caplog):
    # An empty file is a valid web config: no auth. Caught half written on a reload, it served
    # without basic auth; refused, the users in force stay. "{}" says "no settings" by intent.
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alice: {HASH}\n")
    settings = WebSettings(str(web), check_interval_s=0)
    web.write_text("")
    assert settings.current(WAIT_S).users == ("alice",)
    failures = [r.getMessage() for r in caplog.records if "reloading" in r.getMessage()]
    assert failures == [f"reloading {web} failed; kept the web config in force: the file is empty (or only "
                        "comments): refused as probably half written; a config with no settings by intent is {}"]
    web.write_text("{}\n")
    assert settings.current(WAIT_S).users == ()


def test_a_web_config_section_cut_short_is_refused(tmp_path):
    assert errors_of("basic_auth_users:\n") == [
        "basic_auth_users: named with nothing under it: refused as probably cut short; "
        "write basic_auth_users: {} for none"]
    assert errors_of("http_server_config:\n  headers:\n") == [
        "http_server_config.headers: the file ends here with nothing after the colon: refused as probably cut short"]


def test_a_fifo_as_the_web_config_is_refused_without_waiting_for_a_writer(tmp_path):
    web = tmp_path / "web.yml"
    os.mkfifo(web)
    with pytest.raises(ConfigError) as raised:
        load_web_config(web)
    assert raised.value.errors == (
        "cannot read: a FIFO, not a regular file (a config file is read whole, once per reload)",)
