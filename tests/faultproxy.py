"""A TCP fault proxy for tests: forwards 127.0.0.1:<port> to an upstream host:port and, on demand,
adds latency, resets every connection, or stalls all forwarding for a while.

It runs its own asyncio event loop in a background thread; the public methods are called from
the test thread. Each direction of each connection is one reader task that stamps chunks with
a delivery time and one writer task that delivers them in order, so latency and stalls never
reorder bytes. Faults are recorded in ``events`` as (kind, start, end) in ``time.monotonic()``,
and what the proxy did with each chunk in ``deliveries``: when it was read, when it was due, and
when it went out.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from dataclasses import dataclass


@dataclass
class FaultEvent:
    kind: str  # "reset" or "stall"
    start: float  # time.monotonic()
    end: float  # when forwarding was normal again


@dataclass
class Delivery:
    """One chunk forwarded: ``way`` "up" (client to upstream) or "down"; times in ``time.monotonic()``."""

    way: str
    size: int
    read_at: float  # when the proxy read it
    due: float  # read_at plus the latency: not to go out before
    sent_at: float  # when it went out: not before it was due, nor before a stall ended


class _Link:
    """One proxied connection: two sockets and the four tasks pumping bytes between them."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task] = []

    def abort(self) -> None:
        """Close both sockets with a TCP RST (SO_LINGER 0), so both peers see a reset."""
        for w in self.writers:
            sock = w.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass  # already closed
            w.transport.abort()
        for t in self.tasks:
            t.cancel()


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, latency_s: float = 0.0):
        self.upstream = (upstream_host, upstream_port)
        self.latency_s = latency_s  # added to each direction
        self.events: list[FaultEvent] = []
        self.deliveries: list[Delivery] = []  # appended by the proxy's thread, in the order sent
        self.connections = 0  # accepted so far
        self._stalled_until = 0.0
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @classmethod
    def for_endpoint(cls, endpoint: str, latency_s: float = 0.0) -> "FaultProxy":
        """A proxy in front of a ZeroMQ ``tcp://host:port`` endpoint."""
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        return cls(host, int(port), latency_s)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    # ------------------------------------------------------------ life cycle
    def start(self) -> "FaultProxy":
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            self._server.close()
            for link in list(self._links):
                link.abort()
            self._links.clear()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ faults
    def reset_all(self) -> int:
        """Abort every open connection (both sides see a reset); return how many there were."""

        async def reset() -> int:
            links = list(self._links)
            for link in links:
                link.abort()
            self._links.clear()
            return len(links)

        now = time.monotonic()
        n = asyncio.run_coroutine_threadsafe(reset(), self._loop).result(10)
        self.events.append(FaultEvent("reset", now, time.monotonic()))
        return n

    def stall(self, seconds: float) -> None:
        """Hold all bytes (both directions, all connections) for ``seconds``, then deliver them in
        order. Returns at once; new connections are still accepted, their bytes held too."""
        now = time.monotonic()
        self._stalled_until = now + seconds
        self.events.append(FaultEvent("stall", now, now + seconds))

    # ------------------------------------------------------------ forwarding
    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.transport.abort()
            return
        link = _Link()
        link.writers = [c_writer, u_writer]
        self._links.add(link)
        for way, src, dst in (("up", c_reader, u_writer), ("down", u_reader, c_writer)):
            queue: asyncio.Queue = asyncio.Queue()
            link.tasks.append(asyncio.ensure_future(self._read(src, queue)))
            link.tasks.append(asyncio.ensure_future(self._write(dst, queue, link, way)))

    async def _read(self, src: asyncio.StreamReader, queue: asyncio.Queue) -> None:
        try:
            while data := await src.read(65536):
                now = time.monotonic()
                queue.put_nowait((now, now + self.latency_s, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((0.0, 0.0, b""))  # end of stream

    async def _write(self, dst: asyncio.StreamWriter, queue: asyncio.Queue, link: _Link, way: str) -> None:
        try:
            while True:
                read_at, due, data = await queue.get()
                while (wait := max(due, self._stalled_until) - time.monotonic()) > 0:
                    await asyncio.sleep(wait)  # re-checked: a stall may begin while waiting
                if not data:
                    break
                self.deliveries.append(Delivery(way, len(data), read_at, due, time.monotonic()))
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        # One side closed or failed: tear the whole connection down, as a dead TCP path would.
        if link in self._links:
            self._links.discard(link)
            link.abort()
