"""The one place ZeroMQ sockets are built, so every socket gets the same bounded options."""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import os
import queue
import socket as _socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq

from common.protocol import DEFAULT_LIMITS
from common.security import AllowList, CurveKeys, server_keys


@dataclass(frozen=True)
class SocketOptions:
    linger_ms: int = 0
    sndhwm: int = 1000
    rcvhwm: int = 1000
    max_msg_bytes: int = DEFAULT_LIMITS.max_message_bytes
    heartbeat_ivl_ms: int = 2000
    heartbeat_timeout_ms: int = 6000
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5000
    immediate: bool = False  # queue only to completed connections: sends fail fast while disconnected
    curve: CurveKeys | None = None  # server side when curve.server_public is None, client side otherwise


def make_socket(ctx: zmq.Context, kind: int, opts: SocketOptions = SocketOptions()) -> zmq.Socket:
    """A socket with finite high-water marks, LINGER, a message-size cap and ZMTP heartbeats."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.SNDHWM, opts.sndhwm)
    sock.setsockopt(zmq.RCVHWM, opts.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_msg_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, opts.heartbeat_ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, opts.heartbeat_timeout_ms)
    sock.setsockopt(zmq.RECONNECT_IVL, opts.reconnect_ivl_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, opts.reconnect_ivl_max_ms)
    if opts.immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if kind == zmq.ROUTER:
        # Unroutable replies raise instead of vanishing silently, so they are counted.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if opts.curve is not None:
        sock.curve_secretkey = opts.curve.secret
        sock.curve_publickey = opts.curve.public
        if opts.curve.server_public is None:
            sock.curve_server = True
        else:
            sock.curve_serverkey = opts.curve.server_public
    return sock


def check_server_endpoint(endpoint: str, secret: Path | None, allow: Path | None, insecure: bool,
                          flags: tuple[str, str, str] = ("--curve-secret", "--curve-allow", "--insecure"),
                          purpose: str = "bind") -> None:
    """ValueError unless a server socket is safe to bind: CURVE (a secret key and an allow-list,
    both or neither), a loopback or ipc endpoint, or plaintext asked for on purpose. ``flags``
    name the options (secret, allow, insecure) in the message."""
    secret_flag, allow_flag, insecure_flag = flags
    if (secret is None) != (allow is None):
        raise ValueError(f"CURVE needs both {secret_flag} and {allow_flag}")
    if secret is None and not insecure and not is_loopback_endpoint(endpoint):
        raise ValueError(f"refusing to {purpose} {endpoint} without encryption: give {secret_flag} and {allow_flag}, "
                         f"or {insecure_flag} to serve plaintext on a network you trust")


def bind_server(ctx: zmq.Context, endpoint: str, secret: Path | None, allow: Path | None,
                opts: SocketOptions = SocketOptions()) -> tuple[zmq.Socket, AllowList | None]:
    """A bound ROUTER; with ``secret``, CURVE admitting the public keys in ``allow`` (the
    AllowList returned, for SIGHUP's reload and to stop it). A failed bind closes both."""
    allowed = None
    if secret is not None:
        opts = dataclasses.replace(opts, curve=server_keys(secret))
        allowed = AllowList(ctx, allow)
    sock = make_socket(ctx, zmq.ROUTER, opts)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:  # the endpoint is taken, say: nothing is left open behind
        sock.close(linger=0)
        if allowed is not None:
            allowed.stop()
        raise
    return sock, allowed


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// endpoints on a loopback address."""
    parts = urlsplit(endpoint)
    if parts.scheme in ("ipc", "inproc"):
        return True
    if parts.scheme != "tcp":
        return False
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_address(address: str) -> bool:
    """True for a peer address on this machine: a loopback IP, or none at all (ipc, inproc)."""
    if not address:
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)  # ports returned lately, newest last
_HANDED_OUT_LOCK = threading.Lock()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (for tests, the demo and the bench), and not one this
    process was given lately: the kernel may hand a just-closed port out again, and two daemons
    told the same port would collide when they bind it."""
    with _HANDED_OUT_LOCK:
        for _ in range(64):
            with _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                break
        _HANDED_OUT.append(port)
    return port


def free_tcp_endpoint(host: str = "127.0.0.1") -> str:
    """``tcp://host:port`` on a ``free_tcp_port``."""
    return f"tcp://{host}:{free_tcp_port(host)}"


class WakingQueue:
    """A queue another thread fills for a socket's thread to empty, where each ``put`` also
    wakes that thread's poll at once: ``fd`` (a pipe's read end) goes into its ``zmq.Poller``
    beside the socket. After a poll, ``clear()`` first and only then ``get_nowait()`` until
    ``queue.Empty``: an item put after the clear leaves the pipe readable for the next poll."""

    def __init__(self):
        self._items: queue.Queue = queue.Queue()
        self.fd, self._wfd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wfd, False)
        # no write to a descriptor number closed (and perhaps reused); reentrant, for a signal
        # handler that wakes the loop while the loop's own thread is inside clear()
        self._lock = threading.RLock()
        self._closed = False

    def put(self, item) -> None:
        self._items.put(item)
        self.wake()

    def wake(self) -> None:
        """Wake the reader's poll with no item (to see a stop, say)."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._wfd, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups already: the reader is woken
                pass

    def clear(self) -> None:
        """Read the wake-ups that are in the pipe (the items stay)."""
        with self._lock:
            if self._closed:
                return
            try:
                while os.read(self.fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def get(self, timeout: float | None = None):
        return self._items.get(timeout=timeout)

    def get_nowait(self):
        return self._items.get_nowait()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)
                os.close(self._wfd)
