"""A blocking one-request client for the daemons' endpoints (STATS, GENERATE): used by the demo,
the benchmark, status commands and tests."""

from __future__ import annotations

import zmq

from common import protocol as P
from common.protocol import Message
from common.security import CurveKeys
from common.sockets import SocketOptions, make_socket


class ControlTimeout(TimeoutError):
    pass


class ControlClient:
    """``curve``: client keys (``common.security.client_keys``) for an endpoint that speaks CURVE."""

    def __init__(self, endpoint: str, ctx: zmq.Context | None = None, curve: CurveKeys | None = None):
        self.endpoint = endpoint
        self.ctx = ctx or zmq.Context.instance()
        self.curve = curve
        self._connect()

    def _connect(self) -> None:
        self.sock = make_socket(self.ctx, zmq.DEALER, SocketOptions(curve=self.curve))
        self.sock.connect(self.endpoint)

    def call(self, msg: Message, timeout_s: float) -> Message:
        """Send one request and return its reply; an ERROR reply raises RemoteError.
        After a timeout the socket is replaced, so a late reply cannot answer the next call."""
        # a send can block too: a DEALER whose only connection failed its handshake (a CURVE key
        # the server refuses) has no pipe to queue on, and waits for one without end
        self.sock.setsockopt(zmq.SNDTIMEO, max(int(timeout_s * 1000), 1))
        try:
            self.sock.send_multipart(P.encode(msg), copy=False)
        except zmq.Again:
            self.sock.close(linger=0)
            self._connect()
            raise ControlTimeout(f"could not send to {self.endpoint} within {timeout_s:.1f}s") from None
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            self.sock.close(linger=0)
            self._connect()
            raise ControlTimeout(f"no reply from {self.endpoint} within {timeout_s:.1f}s")
        return P.raise_if_error(P.decode(self.sock.recv_multipart(copy=False)))

    def stats(self, timeout_s: float = 5.0) -> dict:
        return self.call(Message(P.MsgType.STATS), timeout_s).header["stats"]

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
