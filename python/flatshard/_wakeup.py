"""The heartbeat's wake-up: one UDP socket per rank, so that waking a peer needs no connection and no store traffic.

[Note: Waking a heartbeat without a connection]
The stall watch's heartbeat sleeps while training is healthy and must wake, on every rank of a
model, once some rank's wait stalls ([Note: A quiet heartbeat] in _stall_watch.py). A blocking wait
on a store key would do it, but only through a store client of its own: a second TCP connection
per rank to the job's store (and, over a FileStore, a poll of the file). Instead each rank binds a
UDP socket on the interface gloo uses (the guard links' address: ``_guard_links.gloo_host``),
publishes ``host:port:token`` under ``wake/<rank>`` in the store once, when its watch starts, and its
heartbeat blocks in ``recv`` on that socket: no connection, no store operation, no CPU while it
waits. A rank whose wait stalled sends each peer its token in a datagram, at every look of the
stall (a datagram may be lost; the next look sends it again), after reading the peers' addresses
once. A datagram without the token (anything else that found the port) is ignored and reported in
a warning naming its sender (once per sender), as the guard's links report a stranger: only a
process that reads the job's store can wake a heartbeat. Where no UDP socket can be bound the heartbeat
waits on its store key through a client of its own, as before. Where a firewall drops UDP between
hosts while TCP passes, a heartbeat on another host does not wake: the ranks waiting in flatshard
still reach their verdicts from each other's records, but a live rank blocked outside flatshard
cannot answer a roll call after a peer died, and is then named among the gone.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading

from flatshard._common import logger

_TOKEN_BYTES = 16
_POLL_SECONDS = 1.0  # how often a waiting heartbeat looks at its stop flag (a timeout of recv: no traffic)
_MAX_REPORTS = 16  # senders reported (once each); more are ignored silently


class Wakeup:
    """This rank's socket: its address for the store, and the wait."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self._sock.bind((host, 0))
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(_POLL_SECONDS)
        self._token = secrets.token_hex(_TOKEN_BYTES)
        host, port = self._sock.getsockname()[:2]
        self.address = f"{host}:{port}:{self._token}"

    def wait(self, stop: threading.Event) -> bool:
        """Blocks until a datagram carrying this rank's token arrives (True) or ``stop`` is set (False)."""
        want = self._token.encode()
        strangers: set[tuple] = set()
        while not stop.is_set():
            try:
                data, sender = self._sock.recvfrom(256)
            except socket.timeout:
                continue
            except OSError:
                if self._sock.fileno() == -1:  # closed under it: the watch is ending
                    return False
                continue  # (a transient error: the next datagram may come)
            if hmac.compare_digest(data, want):
                return not stop.is_set()
            if sender not in strangers and len(strangers) < _MAX_REPORTS:
                strangers.add(sender)
                logger.warning("flatshard: the stall watch's wake-up socket (%s) got a datagram without its token from "
                               "%s:%s; ignored (only a process that reads the job's store can wake it)",
                               self.address.rsplit(":", 1)[0], *sender[:2])
        return False

    def close(self) -> None:
        self._sock.close()


def wake(address: str) -> None:
    """Sends the rank at ``address`` (a ``Wakeup.address``) its token; best effort (see the note)."""
    host, port, token = address.rsplit(":", 2)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(token.encode(), (host, int(port)))
        except OSError:  # unreachable now: the next look sends again
            pass
