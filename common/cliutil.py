"""Shared pieces of the two command lines: options that also read the environment."""

from __future__ import annotations

import functools

from pathlib import Path

import click


def env_options(prefix: str):
    """A click.option that can also be set from ``{prefix}_{NAME}`` and shows its default and
    variable in --help: ``--draft-timeout`` reads ``STARSD_TARGET_DRAFT_TIMEOUT``."""

    def option(*decls: str, **kwargs):
        long = max((d.split("/")[0] for d in decls if d.startswith("--")), key=len)  # --x/--no-x: X
        kwargs.setdefault("envvar", f"{prefix}_{long[2:].upper().replace('-', '_')}")
        kwargs.setdefault("show_envvar", True)
        if "default" in kwargs and not kwargs.get("is_flag"):
            kwargs.setdefault("show_default", True)
        return click.option(*decls, **kwargs)

    return option


def logging_options(option, default_level: str = "info"):
    def decorate(f):
        f = option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=default_level,
                   help="Logging threshold.")(f)
        f = option("--log-format", type=click.Choice(["text", "json"]), default="text",
                   help="Log lines as text or as one JSON object per line.")(f)
        return f

    return decorate


def fail_cleanly(*errors: type[BaseException]):
    """Turn the named exceptions into a one-line error message and exit status 1."""

    def wrap(f):
        @functools.wraps(f)
        def inner(*a, **kw):
            try:
                return f(*a, **kw)
            except errors as exc:
                raise click.ClickException(str(exc)) from exc

        return inner

    return wrap


def status_command(group: click.Group, option, default_endpoint: str, what: str, describe) -> None:
    """Register ``status``: ask a running daemon for its STATS and print ``describe(endpoint,
    stats)`` (a list of lines), or the raw numbers with --json."""

    @group.command(help=f"Print a running {what}'s live numbers.")
    @option("--connect", default=default_endpoint, help=f"Endpoint of the {what} to ask.")
    @option("--timeout", type=click.FloatRange(0.1), default=5.0, help="Seconds to wait for the answer.")
    @option("--json", "as_json", is_flag=True, help="Print the raw numbers as JSON.")
    # no environment variables for these: the daemon's own --curve-* variables mean other keys
    @click.option("--curve-secret", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                  help=f"This client's CURVE secret key file, for a {what} that takes CURVE connections.")
    @click.option("--curve-server-key", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                  help=f"The {what}'s public CURVE key file (with --curve-secret).")
    @fail_cleanly(TimeoutError, ValueError)
    def status(connect, timeout, as_json, curve_secret, curve_server_key) -> None:
        import json

        from common.control import ControlClient
        from common.security import optional_client_keys

        with ControlClient(connect, curve=optional_client_keys(curve_secret, curve_server_key)) as cc:
            stats = cc.stats(timeout)
        click.echo(json.dumps(stats, indent=2) if as_json else "\n".join(describe(connect, stats)))


class LazyGroup(click.Group):
    """A click group whose tooling commands are imported only when invoked (or listed in --help),
    so that the daemon's own command starts without importing them: ``lazy`` maps a command
    name to ``"module:attribute"``."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands:
            import importlib

            module, _, attr = self.lazy[name].partition(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)
