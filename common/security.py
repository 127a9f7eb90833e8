"""CURVE keys for the star: generating them, loading them, and the authenticator that admits
only allowed target keys. Key files use zmq.auth's certificate format."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("starsd.security")


@dataclass(frozen=True)
class CurveKeys:
    """Everything a socket needs for CURVE: its own pair and, for a client, the server's public key."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (keep private) into directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (directory / f"{name}{suffix}").exists():
            raise FileExistsError(f"{directory / (name + suffix)} exists; refusing to overwrite a key")
    public, secret = zmq.auth.create_certificates(directory, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_secret(path: Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE key {path}: {exc}") from None
    if secret is None:
        raise ValueError(f"{path} holds no secret key; pass the .key_secret file")
    return public, secret


def load_public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE public key {path}: {exc}") from None
    return public


def server_keys(secret_file: Path) -> CurveKeys:
    public, secret = load_secret(secret_file)
    return CurveKeys(public, secret)


def client_keys(secret_file: Path, server_key_file: Path) -> CurveKeys:
    public, secret = load_secret(secret_file)
    return CurveKeys(public, secret, load_public(server_key_file))


def optional_client_keys(secret_file: Path | None, server_key_file: Path | None) -> CurveKeys | None:
    """The client's keys when both files are given (--curve-secret, --curve-server-key), None
    when neither is; ValueError for one without the other."""
    if (secret_file is None) != (server_key_file is None):
        raise ValueError("CURVE needs both --curve-secret and --curve-server-key")
    return None if secret_file is None else client_keys(secret_file, server_key_file)


class AllowList:
    """A ZAP authenticator admitting the public keys found in a directory; reload() re-reads it."""

    def __init__(self, ctx: zmq.Context, directory: Path):
        if not directory.is_dir():
            raise ValueError(f"--curve-allow {directory} is not a directory")
        self.directory = directory
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("starsd.security.zap"))
        self.auth.start()
        self.reload()

    def reload(self) -> int:
        self.auth.configure_curve(domain="*", location=str(self.directory))
        n = len(list(self.directory.glob("*.key")))
        log.info("allowing %d public key(s) from %s", n, self.directory)
        return n

    def stop(self) -> None:
        self.auth.stop()
