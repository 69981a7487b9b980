"""Basic auth (``basic_auth_users`` of the web config file): the users' bcrypt hashes, checked,
and ``BasicAuth``, which checks ``Authorization: Basic`` headers against them without paying
bcrypt on every scrape, and without a flood of guesses paying it for everyone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import itertools
import os
import re
import secrets
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mig_exporter.config.checks import at, kind, mapping
from mig_exporter.core.logs import shown

WHERE = "basic_auth_users"
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
_BCRYPT_MAX_PASSWORD = 72  # bcrypt reads no further; Go's and OpenBSD's compare the same prefix
AUTH_CACHE_SIZE = 100  # verified (user, password) pairs; only a verified pair can push one out
AUTH_FAILED_CACHE_SIZE = 100  # wrong pairs, so a scraper with a stale secret costs one check
AUTH_BCRYPT_SLOTS = 1  # bcrypt checks at once: a flood of guesses costs one core
AUTH_PEERS_TRACKED = 4096  # peers whose failed checks are counted for the fair queue
_BCRYPT_ALPHABET = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
BCRYPT_HINT = "make one with: htpasswd -nBC 10 \"\" | tr -d ':\\n'"


def basic_auth_users(value: Any, errors: list[str]) -> dict[str, bytes]:
    """``basic_auth_users`` checked: each user's bcrypt hash, by name."""
    users = {}
    for name, hashed in (mapping(value, WHERE, "a mapping of user names to bcrypt hashes", errors) or {}).items():
        where = at(WHERE, name)
        if not isinstance(name, str):
            errors.append(f"{where}: the user name is {kind(name)}; quote it to make it a string")
        elif not isinstance(hashed, str) or not _BCRYPT_HASH.fullmatch(hashed):
            errors.append(f"{where}: not a bcrypt hash ($2y$, $2b$ or $2a$ and 56 more characters; {BCRYPT_HINT})")
        elif not 4 <= int(hashed[4:6]) <= 31:
            errors.append(f"{where}: bcrypt cost {int(hashed[4:6])} is out of range (4 to 31)")
        else:
            users[name] = hashed.encode("ascii")
    return users


@dataclass(frozen=True, slots=True)
class AuthResult:
    ok: bool
    reason: str  # for the log: who, and why not


class BasicAuth:
    """Checks ``Authorization: Basic`` headers against bcrypt hashes.

    bcrypt costs about 70 ms at cost 10; a scrape every 15 s must not pay it
    each time, and a flood of guesses must not make it pay again:

    - Only verified pairs are cached (bounded, least recently used out first),
      under the user and an HMAC of the password, keyed with a secret made at
      start, so the cache holds no password. A wrong password goes to a
      cache of its own, so guesses can never push a verified pair out.
    - A cache hit takes no lock that a bcrypt check holds.
    - The same pair presented at once by several requests is checked once.
    - At most ``bcrypt_slots`` checks run at once (one core for a flood).
      When they are busy, the next free slot goes to the waiting peer (a
      host; an IPv6 /64) with the fewest failed checks, so a peer sending
      guesses queues behind its own guesses, and a peer that has not failed
      waits only for the checks already running.
    - Every check does the same work whoever is named: one bcrypt check at
      each cost among the configured users, the user's own hash at its cost
      and a decoy at the others (an unknown user: decoys at all), so the
      time taken does not tell which users exist or what their cost is.
    """

    def __init__(
        self,
        users: Mapping[str, bytes],
        *,
        cache_size: int = AUTH_CACHE_SIZE,
        failed_cache_size: int = AUTH_FAILED_CACHE_SIZE,
        bcrypt_slots: int = AUTH_BCRYPT_SLOTS,
        peers_tracked: int = AUTH_PEERS_TRACKED,
        verify: Callable[[bytes, bytes], bool] | None = None,
    ) -> None:
        self._users = {name.encode("utf-8"): hashed for name, hashed in users.items()}
        self._verify = verify or _checkpw
        self._key = os.urandom(32)
        self._lock = threading.Lock()  # the caches and the checks in flight; never held during bcrypt
        self._verified = _Lru(cache_size)
        self._failed = _Lru(failed_cache_size)
        self._flights: dict[tuple[bytes, bytes], _CheckInFlight] = {}
        self._gate = _FairGate(bcrypt_slots, peers_tracked)
        # One decoy per cost: a random salt and digest, so no hashing at load (a reload holds up no
        # connection); checkpw hashes at the decoy's cost and never matches.
        self._decoys = {cost: _decoy(cost) for cost in sorted({_bcrypt_cost(h) for h in self._users.values()})}
        if not self._decoys:
            self._decoys = {4: _decoy(4)}

    def check(self, header: str | None, peer: object = None) -> AuthResult:
        """``peer``: the client's address (a socket address or a host), for the fair queue."""
        parsed = _basic_credentials(header)
        if isinstance(parsed, AuthResult):
            return parsed
        user, password = parsed
        who = _shown(user.decode("utf-8", errors="replace"))
        known = user in self._users
        if self._outcome(self._key_of(user, password), password, peer):
            return AuthResult(True, f"user {who}")
        return AuthResult(False, f"wrong password for user {who}" if known else f"unknown user {who}")

    def needs_check(self, header: str | None) -> bool:
        """Whether ``check(header)`` would run bcrypt: well-formed Basic credentials that are
        in neither cache. The server routes those to a pool of their own."""
        parsed = _basic_credentials(header)
        if isinstance(parsed, AuthResult):
            return False
        key = self._key_of(*parsed)
        with self._lock:
            return not (self._verified.peek(key) or self._failed.peek(key))

    def failures_of(self, peer: object) -> int:
        """Failed checks counted against ``peer``'s group: who waits least for a check."""
        return self._gate.failures(_peer_group(peer))

    def _key_of(self, user: bytes, password: bytes) -> tuple[bytes, bytes]:
        return user, hmac.new(self._key, password, hashlib.sha256).digest()

    def _outcome(self, key: tuple[bytes, bytes], password: bytes, peer: object) -> bool:
        with self._lock:
            if self._verified.get(key):
                return True
            if self._failed.get(key):
                return False
            flight = self._flights.get(key)
            leading = flight is None
            if flight is None:
                flight = self._flights[key] = _CheckInFlight()
        if not leading:  # the same pair is being checked: its outcome, without a second check
            flight.done.wait()
            return flight.ok
        group = _peer_group(peer)
        ok = False
        try:
            self._gate.acquire(group)
            try:
                ok = self._bcrypt(key[0], password)
            finally:
                self._gate.release(group, failed=not ok)
            with self._lock:
                (self._verified if ok else self._failed).put(key)
            flight.ok = ok
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()
        return ok

    def _bcrypt(self, user: bytes, password: bytes) -> bool:
        """The same checks for everyone: one at each configured cost, in the same order."""
        hashed = self._users.get(user)
        own = _bcrypt_cost(hashed) if hashed is not None else None
        ok = False
        for cost, decoy in self._decoys.items():
            if cost == own:
                assert hashed is not None
                ok = self._checkpw(password, hashed)
            else:
                self._checkpw(password, decoy)
        return ok

    def _checkpw(self, password: bytes, hashed: bytes) -> bool:
        try:
            return self._verify(password[:_BCRYPT_MAX_PASSWORD], hashed)
        except ValueError:
            return False


def _basic_credentials(header: str | None) -> tuple[bytes, bytes] | AuthResult:
    """(user, password) of an ``Authorization: Basic`` header, or the failure it is."""
    if not header:
        return AuthResult(False, "no credentials")
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return AuthResult(False, f"{_shown(scheme)} credentials, not Basic")
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return AuthResult(False, "Basic credentials that are not valid base64")
    user, colon, password = decoded.partition(b":")
    if not colon:
        return AuthResult(False, "Basic credentials without a ':' between user and password")
    return user, password


@dataclass(slots=True)
class _CheckInFlight:
    """A check in progress; requests for the same pair wait for its outcome.

    Not ``core.flight.Flights``, on purpose: a check runs in the request's own worker of the
    bounded "auth" pool (so a flood of distinct guesses is held to that pool, not given a thread
    each), and it has no deadline: a check once started is finished and cached, and the pair's
    waiters get its outcome, never a made-up one."""

    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class _Lru:
    """A bounded set, least recently used out first. Not locked: ``BasicAuth._lock`` guards it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()

    def get(self, key: tuple[bytes, bytes]) -> bool:
        if key not in self._items:
            return False
        self._items.move_to_end(key)
        return True

    def peek(self, key: tuple[bytes, bytes]) -> bool:
        """Whether ``key`` is held, without making it recent."""
        return key in self._items

    def put(self, key: tuple[bytes, bytes]) -> None:
        self._items[key] = None
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(list(self._items))


class _FairGate:
    """At most ``slots`` holders at once. A released slot goes straight to the
    waiting peer with the fewest failures on record (ties: the one waiting
    longest), so a peer's failures queue it behind everyone else's first
    tries. Failures are kept for ``peers_tracked`` peers, the least recently
    failing forgotten first; a success clears a peer's record."""

    def __init__(self, slots: int, peers_tracked: int) -> None:
        self._lock = threading.Lock()
        self._free = max(1, slots)
        self._waiting: dict[str, deque[tuple[int, threading.Event]]] = {}
        self._failures: OrderedDict[str, int] = OrderedDict()
        self._peers_tracked = peers_tracked
        self._tickets = itertools.count()

    def acquire(self, peer: str) -> None:
        with self._lock:
            if self._free > 0:  # then no one waits: a release hands its slot straight over
                self._free -= 1
                return
            ticket = threading.Event()
            self._waiting.setdefault(peer, deque()).append((next(self._tickets), ticket))
        ticket.wait()

    def release(self, peer: str, *, failed: bool) -> None:
        with self._lock:
            if failed:
                self._failures[peer] = self._failures.get(peer, 0) + 1
                self._failures.move_to_end(peer)
                while len(self._failures) > self._peers_tracked:
                    self._failures.popitem(last=False)
            else:
                self._failures.pop(peer, None)
            if not self._waiting:
                self._free += 1
                return
            chosen = min(self._waiting, key=lambda p: (self._failures.get(p, 0), self._waiting[p][0][0]))
            queue = self._waiting[chosen]
            _, ticket = queue.popleft()
            if not queue:
                del self._waiting[chosen]
            ticket.set()

    def waiting(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._waiting.values())

    def failures(self, peer: str) -> int:
        with self._lock:
            return self._failures.get(peer, 0)


def _peer_group(peer: object) -> str:
    """Whom a request counts against: its host, an IPv4-mapped address as IPv4, IPv6 by /64 (one
    machine has a whole /64 to send from)."""
    host = peer[0] if isinstance(peer, tuple) and peer else peer
    if host is None:
        return ""
    text = str(host)
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _checkpw(password: bytes, hashed: bytes) -> bool:
    # bcrypt is imported where a password is first checked: a server without basic auth
    # (most) never maps its library (half a MiB of resident memory).
    import bcrypt

    return bool(bcrypt.checkpw(password, hashed))


def _bcrypt_cost(hashed: bytes) -> int:
    return int(hashed[4:6])


def _decoy(cost: int) -> bytes:
    """A well-formed bcrypt hash of the given cost that no password matches."""
    import bcrypt  # see _checkpw

    digest = "".join(secrets.choice(_BCRYPT_ALPHABET) for _ in range(31))
    return bcrypt.gensalt(rounds=cost) + digest.encode("ascii")


def _shown(text: str) -> str:
    return shown(text, 66)
