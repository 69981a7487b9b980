"""What the tests of the port's memory bounds share: clients that send a request and never read
its answer, the status line such a client was sent, and a wait for what the server's loop does."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def eventually(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Wait (``timeout_s`` at most) for what another thread does; not a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened within {timeout_s}s: {what}"
        time.sleep(0.01)


def non_reader(port: int, path: str = "/metrics") -> socket.socket:
    """A client that sends ``GET path`` and never reads, with a 4 KiB receive buffer: its
    answer stays queued in the server."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def answer_status(s: socket.socket, timeout_s: float = 10.0) -> int:
    """The status of the answer a non-reader was sent (its first bytes fit its buffer)."""
    s.settimeout(timeout_s)
    head = b""
    while b"\r\n" not in head:
        chunk = s.recv(64)
        assert chunk, head
        head += chunk
    return int(head.split()[1])
