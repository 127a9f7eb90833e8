"""Shared pieces of the two command lines: options that also read the environment, and read their
defaults from a configuration dataclass."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click


def env_options(prefix: str):
    """A click.option that can also be set from ``{prefix}_{NAME}`` and shows its default and
    variable in --help: ``--draft-timeout`` reads ``STARSD_TARGET_DRAFT_TIMEOUT``."""

    def option(*decls: str, **kwargs):
        long = max((d.split("/")[0] for d in decls if d.startswith("--")), key=len)  # --x/--no-x: X
        kwargs.setdefault("envvar", f"{prefix}_{long[2:].upper().replace('-', '_')}")
        kwargs.setdefault("show_envvar", True)
        kwargs.setdefault("show_default", True)
        return click.option(*decls, **kwargs)

    return option


@dataclass(frozen=True)
class Unit:
    """An option's unit where its configuration field has another: field value = to_field(option value)."""

    to_field: Callable[[Any], Any]
    to_option: Callable[[Any], Any]


MS = Unit(lambda ms: ms / 1000, lambda s: s * 1000)  # the option in milliseconds, the field in seconds
MIB = Unit(lambda mib: mib << 20, lambda n: n >> 20)  # the option in MiB, the field in bytes


class ConfigOptions:
    """The options of a command that set the fields of a configuration dataclass: each option is
    named after its field unless ``renamed`` maps its parameter name to the field's (and, where the
    units differ, a Unit). ``default(option)`` is the field's default in the option's unit, for
    ``default=``; ``values(params)`` takes those options out of a command's parameters, as fields."""

    def __init__(self, cls: type, renamed: dict[str, str | tuple[str, Unit]] | None = None):
        self.cls = cls
        self.fields = {f.name: f for f in dataclasses.fields(cls)}
        self.renamed = {opt: (to, None) if isinstance(to, str) else to for opt, to in (renamed or {}).items()}

    def field(self, option: str) -> tuple[str, Unit | None] | None:
        """The field an option (by parameter name) sets and its unit; None for an option of no field."""
        if option in self.renamed:
            return self.renamed[option]
        return (option, None) if option in self.fields else None

    def default(self, option: str):
        name, unit = self.field(option)
        f = self.fields[name]
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        return value if unit is None else unit.to_option(value)

    def values(self, params: dict) -> dict:
        """Field values from (and removed from) ``params``, a command's parsed options."""
        out = {}
        for option in [o for o in params if self.field(o) is not None]:
            name, unit = self.field(option)
            value = params.pop(option)
            out[name] = value if unit is None or value is None else unit.to_field(value)
        return out


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
