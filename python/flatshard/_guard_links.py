"""The rank guard's two-rank links: a TCP connection per partner, written and read on the training thread.

[Note: The guard's links]
Each round of the guard's exchange ([Note: The guard's exchange in log W rounds]) swaps 128
bytes with one partner. Over a two-rank gloo group that swap is a collective: the training
thread hands it to gloo's worker thread, which sends it; the partner's worker receives it and
wakes the partner's training thread. Each hand-off needs a core; where the ranks outnumber the
cores (four ranks on two) every one waits for a scheduler slice, and a round took 1.7 ms at
W = 4 on this machine (0.19 ms at W = 2) where the same bytes over a socket written and read
by the training threads themselves take 0.05 ms (benchmarks/RESULTS.md, guard cost). So each
pair of partners holds a TCP connection of its own (``TCP_NODELAY``): the lower rank of the
pair listens on an ephemeral port of the interface gloo would use (the address of
``GLOO_SOCKET_IFNAME``'s interface if set, else the host name's address: not every
interface) and publishes that address and a fresh random secret under the pair's key in
the job's store; the higher one connects and presents the secret. A connection that
presents anything else (something that found the port during the rendezvous) is closed,
reported in a warning naming where it came from, and the listener waits on for its partner:
only a process that can read the job's store can pose as one. A pair whose connection
cannot be made (a firewall, an unroutable host name) says so in the store, and both
partners use a two-rank gloo group for that pair instead, as before.

Why links of its own rather than c10d's: torch ships two tools near this. ProcessGroupWrapper
(TORCH_DISTRIBUTED_DEBUG=DETAIL) checks every collective's fingerprint before it runs, over a gloo
helper group of all ranks: an all-rank group (W - 1 connections per rank) and a check per
collective, which is the cost this guard's per-phase design avoids (its strict mode is the
per-collective check, on the collective's own group). The NCCL flight recorder dumps the last
collectives after a timeout: a post-mortem of a hang that already happened (30 minutes on gloo by
default), NCCL only, where the guard stops the ranks before the mismatched collective, with a
message. A two-rank gloo group per round would do what a link does, with gloo's worker-thread
hand-offs on every swap (see above), so it remains only the fallback.

A swap sends this rank's bytes (never blocking: they fit the socket's buffer) and reads the
partner's, waiting in slices so that the stall watch can look where the peers are between
them ([Note: Stalled waits]); the group's timeout bounds the whole wait. A partner that died
closes its end: the read sees it at once, and the error says the connection closed, as gloo's
would, so that the stall watch's roll call names who is gone.
"""

from __future__ import annotations

import fcntl
import hmac
import os
import secrets
import socket
import struct
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from flatshard._common import logger

_HELLO = b"flatshard-guard-link\n"  # followed by the pair's secret (_SECRET_BYTES, from the store)
_SECRET_BYTES = 32
_IFNAME_ADDRESS = 0x8915  # SIOCGIFADDR


class LinkClosed(RuntimeError):
    """The partner closed its end of the link (it exited or died)."""


def _interface_address(name: str) -> str:
    """IPv4 address of the network interface ``name`` (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), _IFNAME_ADDRESS, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def gloo_host() -> str:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        return _interface_address(ifname)
    return socket.gethostbyname(socket.gethostname())


class SocketLink:
    """One end of a TCP connection to the partner of a round."""

    def __init__(self, sock: socket.socket, timeout: timedelta) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)
        self._sock = sock
        self._timeout = timeout.total_seconds()

    def swap(self, outgoing: bytes, wait: Callable[[Callable[[float], bool]], None]) -> bytes:
        """Sends ``outgoing`` and returns as many bytes read from the partner, waiting through ``wait``."""
        view = memoryview(bytearray(len(outgoing)))
        try:
            self._sock.settimeout(None)  # (the last read's slice may have left a short timeout: never for the send)
            self._sock.sendall(outgoing)
        except OSError as e:
            raise LinkClosed(f"Connection closed by peer ({e})") from e
        got = 0
        deadline = time.monotonic() + self._timeout

        def ready(seconds: float) -> bool:
            nonlocal got
            end = min(time.monotonic() + seconds, deadline)
            while got < len(view):
                left = end - time.monotonic()
                if left <= 0:
                    if time.monotonic() >= deadline:
                        raise RuntimeError(f"flatshard: the rank guard's link timed out after {self._timeout:.0f} s")
                    return False
                self._sock.settimeout(left)
                try:
                    n = self._sock.recv_into(view[got:])
                except socket.timeout:
                    continue
                except OSError as e:
                    raise LinkClosed(f"Connection closed by peer ({e})") from e
                if n == 0:
                    raise LinkClosed("Connection closed by peer")
                got += n
            return True

        wait(ready)
        return view.tobytes()

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class GlooLink:
    """The same swap over a two-rank gloo group (where no connection could be made)."""

    def __init__(self, group: Any, slot: int) -> None:
        self._group = group
        self._slot = slot
        self._buffer: torch.Tensor | None = None

    def swap(self, outgoing: bytes, wait: Callable[[Callable[[float], bool]], None]) -> bytes:
        n = len(outgoing)
        if self._buffer is None or self._buffer.numel() != 2 * n:
            with torch.inference_mode(False):  # (a first check under inference_mode must not make an inference tensor)
                self._buffer = torch.zeros(2 * n, dtype=torch.uint8)
        with torch.inference_mode(False):
            mine = torch.frombuffer(bytearray(outgoing), dtype=torch.uint8)
            work = self._group._allgather_base(self._buffer, mine)

        def ready(seconds: float) -> bool:
            try:
                work.wait(timeout=timedelta(seconds=seconds))
                return True
            except RuntimeError as e:
                if "timed out" not in str(e) or work.is_completed():
                    raise
                return False

        wait(ready)
        return self._buffer[(1 - self._slot) * n:(2 - self._slot) * n].numpy().tobytes()

    def close(self) -> None:
        pass


def make_link(prefix: str, slot: int, timeout: timedelta) -> SocketLink | GlooLink:
    """This rank's end of the pair rendezvousing under ``prefix`` in the default store (slot 0: the lower rank).
    Both ends make it at the same point of the same program (the guard's construction)."""
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    deadline = time.monotonic() + timeout.total_seconds()
    sock = None
    try:
        sock = _accept(store, deadline) if slot == 0 else _connect(store, deadline)
    except OSError as e:
        sock = None
        store.set(f"failed/{slot}", str(e)[:200])
    if sock is None and not store.check([f"failed/{slot}"]):
        store.set(f"failed/{slot}", "no connection")
    partner_gave_up = False
    if sock is not None:
        # Both ends agree before using it: a connection one end gave up on is not used by the other.
        store.set(f"ready/{slot}", "1")
        if _first_of(store, [f"ready/{1 - slot}", f"failed/{1 - slot}"], deadline) != f"ready/{1 - slot}":
            sock.close()
            sock = None
            partner_gave_up = True
    if sock is None:
        logger.warning("flatshard: the rank guard's link %r (this rank's end: %d) falls back to a gloo pair, "
                       "which costs a gloo group per link: %s", prefix, slot,
                       _why_no_connection(store, slot, partner_gave_up))
        group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), slot, 2, timeout)
        return GlooLink(group, slot)
    return SocketLink(sock, timeout)


def _why_no_connection(store: Any, slot: int, partner_gave_up: bool) -> str:
    """What each end of a pair recorded on giving up its connection (the OSError, or "no connection"), for the
    fallback's warning."""
    def recorded(end: int) -> str | None:
        key = f"failed/{end}"
        return store.get(key).decode(errors="replace") if store.check([key]) else None

    mine = "connected, but the partner gave up" if partner_gave_up else (recorded(slot) or "no connection")
    return f"this end: {mine}; the partner: {recorded(1 - slot) or 'nothing recorded (yet)'}"


def _first_of(store: Any, keys: list[str], deadline: float) -> str | None:
    """The first of ``keys`` set in ``store`` (polled), or None at ``deadline``."""
    while True:
        for key in keys:
            if store.check([key]):
                return key
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


def _accept(store: Any, deadline: float) -> socket.socket | None:
    host = gloo_host()
    secret = secrets.token_bytes(_SECRET_BYTES)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(8)
        store.set("secret", secret)
        store.set("address", f"{host}|{listener.getsockname()[1]}")
        listener.settimeout(0.05)
        while True:  # until the partner connects, or says it could not
            try:
                sock, peer = listener.accept()
            except socket.timeout:
                if store.check(["failed/1"]) or time.monotonic() > deadline:
                    return None
                continue
            sock.settimeout(min(5.0, max(0.5, deadline - time.monotonic())))
            try:
                greeting = _read_exactly(sock, len(_HELLO) + _SECRET_BYTES)
            except OSError:
                greeting = b""
            if hmac.compare_digest(greeting, _HELLO + secret):
                return sock
            sock.close()
            refused.append(f"{peer[0]}:{peer[1]}")
            logger.warning("flatshard: the rank guard's link at %s:%d refused a connection from %s:%d that did not "
                           "present the pair's secret (something other than its partner found the port); still "
                           "waiting for the partner", host, listener.getsockname()[1], peer[0], peer[1])
    finally:
        listener.close()


def _connect(store: Any, deadline: float) -> socket.socket | None:
    if _first_of(store, ["address", "failed/0"], deadline) != "address":
        return None
    address, port = store.get("address").decode().split("|")
    secret = store.get("secret")
    sock = socket.create_connection((address, int(port)), timeout=max(1.0, min(30.0, deadline - time.monotonic())))
    sock.sendall(_HELLO + secret)
    return sock


# Where connections that did not present a pair's secret came from, in this process (tests read it).
refused: list[str] = []


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data
