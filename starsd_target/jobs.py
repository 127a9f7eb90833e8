"""The target's job socket: GENERATE and STATS over the wire protocol, served beside the HTTP API.

It serves the demo, the bench, `starsd-target status` and scripts that speak the wire protocol.
It binds loopback or ipc only, unless CURVE admits just the listed client keys (or
--insecure-listen says plaintext on purpose), as the draft daemon refuses a routable bind without
CURVE. It answers STATS to whoever reaches it, but takes GENERATE only from a client it can tell
is allowed: over CURVE, or over an ipc:// endpoint whose socket file only this service's user may
open (it is made so); on a plaintext TCP endpoint, any user of the machine could submit jobs, so
GENERATE there needs --insecure-listen. Its loop is also the daemon's heartbeat: each pass checks
the scheduler's health, ticks systemd's watchdog and re-reads the allow-list after a SIGHUP."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

import zmq

from common import protocol as P
from common.metrics import serve_metrics
from common.protocol import ErrorCode, Message, MsgType, ProtocolError
from common.sdnotify import Watchdog, notify
from common.security import AllowList
from common.sockets import WakingQueue, bind_server
from common.verify import SamplingParams
from starsd_target.scheduler import Overloaded, Scheduler, SchedulerFailed, ShuttingDown

if TYPE_CHECKING:
    from starsd_target.daemon import TargetDaemon

log = logging.getLogger("starsd.target")

# the job socket's loop wakes at once for a request, a reply or a stop, and at least this often
# for its other duties: the scheduler's health, systemd's watchdog, a key reload
CONTROL_POLL_MS = 100


class ServiceFailed(RuntimeError):
    """The scheduler died or stalled: the daemon stops serving and exits non-zero to be restarted."""


class JobSocket:
    """A target daemon's job socket, served by ``serve`` until ``stop``: requests become the
    daemon's jobs, and each job's reply is sent from this loop's thread when the job ends."""

    def __init__(self, daemon: TargetDaemon):
        self.daemon = daemon
        self._stop = threading.Event()
        self._reload_keys = threading.Event()  # SIGHUP: re-read --listen-curve-allow
        self._replies: WakingQueue | None = None  # the replies, while it serves
        self.allow: AllowList | None = None
        self.endpoint: str | None = None  # the bound endpoint, once serving
        self.failure: ServiceFailed | None = None  # set when serving ended because the scheduler failed
        self.served = 0  # results sent
        self.jobs_refused: str | None = None  # why GENERATE is refused here (None: it is taken)
        self.refused_jobs = 0  # GENERATE requests refused for that

    def stop(self) -> None:
        self._stop.set()
        replies = self._replies
        if replies is not None:
            replies.wake()  # the loop sees the stop now, not at its next timeout

    def reload_keys(self) -> None:
        self._reload_keys.set()

    def serve(self, ready: threading.Event | None = None, notify_ready: bool = True) -> None:
        """Take GENERATE jobs on a ROUTER socket until stopped; generations run concurrently in
        the scheduler. On stop, jobs in progress finish and queued ones get SHUTTING_DOWN."""
        config = self.daemon.config
        replies = self._replies = WakingQueue()  # filled by job callbacks, sent by this thread
        sched = self.daemon.scheduler()
        sched.start()
        if config.metrics_port is not None:
            serve_metrics(self.daemon.metrics.registry, config.metrics_port)
        # an ipc file (not an abstract socket, ipc://@name, which has no permissions to keep others out)
        private = (config.listen.startswith("ipc://") and not config.listen.startswith("ipc://@")
                   and config.listen_curve_secret is None)
        mask = os.umask(0o077) if private else None  # the socket file is this user's from the start
        try:
            sock, self.allow = bind_server(self.daemon.ctx, config.listen, config.listen_curve_secret,
                                           config.listen_curve_allow)
        finally:
            if mask is not None:
                os.umask(mask)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if private:
            os.chmod(self.endpoint[len("ipc://"):], 0o600)
        self.jobs_refused = None if self.allow is not None or private or config.insecure_listen else (
            f"this job socket ({self.endpoint}) takes GENERATE only over CURVE (--listen-curve-secret and "
            "--listen-curve-allow) or an ipc:// endpoint (its file is this service's user's alone); "
            "--insecure-listen takes them from anyone who can reach it")
        log.info("target daemon taking %s on %s (%s)", "status requests only" if self.jobs_refused else "jobs",
                 self.endpoint, "CURVE" if self.allow else "ipc, this user only" if private else "plaintext")
        if ready is not None:
            ready.set()
        if notify_ready:
            notify("READY=1", f"STATUS=taking jobs on {self.endpoint}")
        watchdog = Watchdog()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(replies.fd, zmq.POLLIN)  # a reply is sent the moment it is put
        pending = 0
        try:
            while not self._stop.is_set():
                if not sched.healthy():
                    self._fail(sched)
                    break
                if watchdog.due():
                    watchdog.tick()
                if self._reload_keys.is_set() and self.allow is not None:
                    self._reload_keys.clear()
                    self.allow.reload()
                events = dict(poller.poll(CONTROL_POLL_MS))
                if events.get(sock):
                    frames = sock.recv_multipart(copy=False)
                    pending += self._on_control(frames, replies)
                replies.clear()  # before taking the replies: one put after this wakes the next poll
                pending -= self._send_replies(sock, replies)
            notify("STOPPING=1", "STATUS=finishing jobs in progress")
            sched.stop(0.0 if self.failure else 60.0)  # queued jobs fail with SHUTTING_DOWN, running ones finish
            while sock.poll(0, zmq.POLLIN):  # requests that arrived meanwhile are refused
                pending += self._on_control(sock.recv_multipart(copy=False), replies)
            deadline = time.monotonic() + 5.0
            while pending > 0 and time.monotonic() < deadline:
                pending -= self._send_replies(sock, replies, wait_s=0.05)
            log.info("target daemon stopped")
        finally:
            # give the last replies (results, refusals) a moment to leave
            sock.close(linger=1000 if self._stop.is_set() or self.failure else 0)
            replies.close()
            if self.allow is not None:
                self.allow.stop()
            self.daemon.close_link()

    def _fail(self, sched: Scheduler) -> None:
        """The scheduler died or stalled: stop serving, for the process to exit non-zero (and
        systemd to restart it) rather than look alive and serve nothing."""
        why = f"failed: {sched.failure!r}" if sched.failure is not None else "stalled"
        self.failure = ServiceFailed(f"the target's scheduler {why}; exiting to be restarted")
        log.critical("%s", self.failure)
        sched.abandon(SchedulerFailed(f"the target's scheduler {why}; the daemon is restarting"))
        notify(f"STATUS=scheduler {why}")

    @staticmethod
    def _send_replies(sock: zmq.Socket, replies: WakingQueue, wait_s: float = 0.0) -> int:
        sent = 0
        while True:
            try:
                identity, msg = replies.get(timeout=wait_s) if wait_s and not sent else replies.get_nowait()
            except queue.Empty:
                return sent
            try:
                sock.send_multipart([identity, *P.encode(msg)], zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:
                log.warning("could not return a reply to its client: %s", exc)
            sent += 1

    def _on_control(self, frames: list, replies: WakingQueue) -> int:
        """Handle one control message; returns 1 (a reply will be queued) in every case."""
        identity = frames[0].bytes
        try:
            msg = P.decode(frames[1:])
            if msg.type is MsgType.STATS:
                replies.put((identity, Message(MsgType.STATS_REPLY, {"stats": self.daemon.status()})))
                return 1
            if msg.type is not MsgType.GENERATE:
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{msg.type.name} is not a target request")
            h = msg.header
            rid = h["id"]
            if self.jobs_refused is not None:
                self.refused_jobs += 1
                raise ProtocolError(ErrorCode.NOT_ALLOWED, self.jobs_refused, rid)
            prompt = h.get("prompt_ids") if "prompt_ids" in h else h.get("prompt")
            if prompt is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "GENERATE needs prompt or prompt_ids", rid)
            try:
                params = SamplingParams(float(h.get("temperature", 0.0)), int(h.get("top_k", 0)),
                                        float(h.get("top_p", 1.0)), h.get("seed"))
                job = self.daemon.job(prompt, h["max_tokens"], params, h.get("stop", ()), h.get("no_draft", False),
                                      max_draft=h.get("max_draft_tokens"))
                future = self.daemon.submit(job)
            except ValueError as exc:
                raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc), rid) from None
            except Overloaded as exc:
                raise ProtocolError(ErrorCode.BUSY, str(exc), rid) from None
            except ShuttingDown as exc:
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, str(exc), rid) from None
            future.add_done_callback(lambda f: replies.put((identity, self._result_message(rid, f))))
        except ProtocolError as exc:
            replies.put((identity, P.error_from(exc)))
        except Exception as exc:  # a request this code did not foresee costs that request only
            log.exception("a job request failed")
            replies.put((identity, P.error(ErrorCode.INTERNAL, f"internal error: {exc}")))
        return 1

    def _result_message(self, rid: int, future) -> Message:
        exc = future.exception()
        if isinstance(exc, ShuttingDown):
            return P.error(ErrorCode.SHUTTING_DOWN, str(exc), rid)
        if exc is not None:
            return P.error(ErrorCode.GENERATION_FAILED, f"generation failed: {exc}", rid)
        result = future.result()
        self.served += 1
        return Message(MsgType.RESULT, {"id": rid, "text": result.text, "token_ids": result.token_ids,
                                        "stats": {**result.stats.to_dict(), "finish_reason": result.finish_reason}})
