"""The target daemon's application wiring: its configuration, the daemon it builds, and run(config)."""

from __future__ import annotations

import zmq

from common.heap import freeze_startup_objects
from common.sdnotify import notify
from starsd_target.config import TargetConfig
from starsd_target.daemon import TargetDaemon, check_listen


def build_daemon(config: TargetConfig, ctx: zmq.Context | None = None) -> TargetDaemon:
    """The target model loaded and warmed up, and with a draft daemon configured, its link up (or
    waited for up to --connect-timeout) and the feature path warmed up if its head wants features."""
    daemon = TargetDaemon(config, ctx=ctx)
    daemon.warm_up()
    if config.draft is not None:
        daemon.connect()
        daemon.warm_up()  # the feature path, if the draft daemon's head wants features
    return daemon


def run(config: TargetConfig) -> None:
    """Serve jobs (and HTTP with ``config.http``) until SIGTERM; raises ServiceFailed when the
    scheduler failed or stalled, for the process to exit non-zero and be restarted."""
    check_listen(config)  # before the model loads
    if config.api_key is not None and config.http is None:
        raise ValueError("--api-key guards the HTTP API: give --http too")
    if config.api_key is not None and not config.api_key.strip():
        raise ValueError("--api-key is empty")  # (a key read from a file keeps no trailing newline: it is stripped)
    if config.http is not None:
        from starsd_target.http_api import parse_paths

        parse_paths(config.api_open_paths)  # a bad path fails here, before the model loads
    ctx = zmq.Context()
    daemon = build_daemon(config, ctx)
    daemon.scheduler()
    if config.http is None:
        daemon.install_signal_handlers()
        freeze_startup_objects("target daemon")
        daemon.serve_forever()
    else:
        serve_http(daemon, config.http, config.served_model_name or daemon.loaded.path.name)
    if daemon.failure is not None:
        raise daemon.failure  # no ctx.term(): a stalled scheduler thread still holds its socket
    ctx.term()  # returns once the last replies have left, within the sockets' linger


def serve_http(daemon: TargetDaemon, addr: str, model_name: str) -> None:
    """uvicorn in this thread (it owns SIGTERM/SIGINT and drains HTTP requests) on ``addr``
    (HOST:PORT); the job socket and the scheduler in their own threads, stopped once uvicorn has
    finished."""
    import threading

    import uvicorn

    from starsd_target.http_api import create_app

    host, _, port = addr.rpartition(":")

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # listening now: tell systemd
                notify("READY=1", f"STATUS=serving HTTP on {addr}")

        async def on_tick(self, counter: int) -> bool:
            # the job socket's thread ends serving when the scheduler fails: HTTP ends with it
            return await super().on_tick(counter) or daemon.failure is not None

    config = uvicorn.Config(create_app(daemon, model_name), host=host.strip("[]"), port=int(port), log_config=None,
                            timeout_graceful_shutdown=30)
    freeze_startup_objects("target daemon")  # before any job can come
    ready = threading.Event()
    control = threading.Thread(target=daemon.serve_forever, kwargs={"ready": ready, "notify_ready": False},
                               name="starsd-control", daemon=True)
    control.start()
    # READY=1 goes out once uvicorn listens, and must mean /health answers 200: the job socket is
    # bound and the scheduler runs before uvicorn starts (on a loaded host the thread came later)
    while not ready.wait(0.1) and control.is_alive():
        pass
    # uvicorn takes SIGTERM/SIGINT while it runs, drains HTTP, then re-raises the signal: our
    # handler then stops the job socket and the scheduler instead of the default kill.
    daemon.install_signal_handlers()
    Server(config).run()
    daemon.stop()
    control.join(90)
