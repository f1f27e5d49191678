"""Channels to a scheduler, plaintext or TLS, and the client-side security flags (the `splitserve` command
line, the gateway's `--scheduler-*`). Nothing of the services is imported.

Without any TLS setting a channel is plaintext (a local scheduler started with --plaintext). With
`tls_ca` (or `tls=True`: the system's CAs) the scheduler's certificate is verified against the address's
host name (or `tls_server_name`); `tls_cert` / `tls_key` add a client certificate, which a scheduler in
mutual TLS (its --tls-ca) requires. An API key travels as the metadata `authorization: Bearer KEY`.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from common.util import RECONNECT_OPTIONS

API_KEY_ENV = "SPLITSERVE_API_KEY"
TLS_ENV = {"tls_ca": "SPLITSERVE_TLS_CA", "tls_cert": "SPLITSERVE_TLS_CERT", "tls_key": "SPLITSERVE_TLS_KEY"}

PathOrPem = str | os.PathLike | bytes  # bytes: the PEM data itself


def _pem(value: PathOrPem | None, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {value}: {e.strerror or e}") from None


@dataclass(frozen=True, repr=False)
class ChannelSecurity:
    """How a client reaches the scheduler: TLS settings and an API key (all optional)."""
    tls: bool = False  # TLS even without tls_ca (the system's CAs verify the scheduler)
    tls_ca: PathOrPem | None = None
    tls_cert: PathOrPem | None = None
    tls_key: PathOrPem | None = None
    tls_server_name: str | None = None  # the name the scheduler's certificate must carry (default: the host)
    api_key: str | None = None

    def __repr__(self) -> str:  # never the key
        return (f"ChannelSecurity(tls={self.uses_tls}, client_certificate={self.tls_cert is not None}, "
                f"api_key={'set' if self.api_key else 'none'})")

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls or self.tls_ca is not None or self.tls_cert is not None or self.tls_server_name)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.uses_tls:
            return None
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a client certificate needs both tls_cert and tls_key")
        return grpc.ssl_channel_credentials(root_certificates=_pem(self.tls_ca, "tls_ca"),
                                            private_key=_pem(self.tls_key, "tls_key"),
                                            certificate_chain=_pem(self.tls_cert, "tls_cert"))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if not self.api_key:
            return ()
        key = self.api_key.strip()
        if not key.isascii() or not key.isprintable() or " " in key:
            raise ValueError("an API key must be printable ASCII without spaces")
        return (("authorization", f"Bearer {key}"),)

    def kwargs(self) -> dict:
        """As keyword arguments of Client / AsyncClient."""
        return {"tls": self.tls, "tls_ca": self.tls_ca, "tls_cert": self.tls_cert, "tls_key": self.tls_key,
                "tls_server_name": self.tls_server_name, "api_key": self.api_key}


# gRPC shares one connection between the channels of a process that have the same target and options, so
# several clients would reach one front-end of a scheduler only: each channel has a connection of its own. A
# scheduler that comes back is reached within RECONNECT_OPTIONS' backoff.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), *RECONNECT_OPTIONS]


def create_channel(address: str, security: ChannelSecurity | None = None, *, aio: bool = False,
                   options: list | None = None):
    """A grpc (or grpc.aio) channel to `address`, plaintext or TLS as `security` says, on a connection of its
    own."""
    security = security or ChannelSecurity()
    options = [*CHANNEL_OPTIONS, *(options or []), *security.options()]
    credentials = security.credentials()
    module = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(address, options=options)
    return module.secure_channel(address, credentials, options=options)


# ---- command-line flags ----------------------------------------------------------------------------


def add_security_arguments(parser: argparse.ArgumentParser, prefix: str = "", *, api_key_env: str | None = API_KEY_ENV,
                           tls_env: bool = True, title: str = "connection security") -> None:
    """--[prefix]tls, --[prefix]tls-ca, --[prefix]tls-cert, --[prefix]tls-key, --[prefix]tls-server-name,
    --[prefix]api-key, --[prefix]api-key-file. Defaults from the environment where named (None: none)."""
    env = (lambda name: os.environ.get(TLS_ENV[name])) if tls_env else (lambda name: None)
    g = parser.add_argument_group(title, "Plaintext unless a TLS option is given.")
    f = f"--{prefix}"
    g.add_argument(f"{f}tls", action="store_true",
                   help="TLS, verifying the scheduler with the system's CAs (implied by the options below)")
    g.add_argument(f"{f}tls-ca", default=env("tls_ca"), metavar="PATH",
                   help="CA bundle (PEM) that verifies the scheduler's certificate; implies TLS"
                        + (f" (default ${TLS_ENV['tls_ca']})" if tls_env else ""))
    g.add_argument(f"{f}tls-cert", default=env("tls_cert"), metavar="PATH",
                   help="client certificate (PEM), for a scheduler in mutual TLS"
                        + (f" (default ${TLS_ENV['tls_cert']})" if tls_env else ""))
    g.add_argument(f"{f}tls-key", default=env("tls_key"), metavar="PATH",
                   help="the private key of the client certificate" + (f" (default ${TLS_ENV['tls_key']})"
                                                                      if tls_env else ""))
    g.add_argument(f"{f}tls-server-name", metavar="NAME",
                   help="the name the scheduler's certificate must carry, when it differs from the address's host")
    g.add_argument(f"{f}api-key", default=os.environ.get(api_key_env) if api_key_env else None, metavar="KEY",
                   help="sent as `authorization: Bearer KEY`" + (f" (default ${api_key_env})" if api_key_env else ""))
    g.add_argument(f"{f}api-key-file", type=Path, metavar="PATH", help="a file holding the API key (e.g. a secret)")


def security_from_args(args: argparse.Namespace, prefix: str = "") -> ChannelSecurity:
    """The ChannelSecurity of add_security_arguments' flags; ValueError on an unusable combination."""
    get = lambda name: getattr(args, prefix.replace("-", "_") + name)  # noqa: E731
    flag = f"--{prefix}"
    api_key = get("api_key")
    if get("api_key_file") is not None:
        try:
            api_key = get("api_key_file").read_text().strip()
        except OSError as e:
            raise ValueError(f"{flag}api-key-file {get('api_key_file')}: {e.strerror or e}") from None
    if (get("tls_cert") is None) != (get("tls_key") is None):
        raise ValueError(f"{flag}tls-cert and {flag}tls-key go together")
    return ChannelSecurity(tls=get("tls"), tls_ca=get("tls_ca"), tls_cert=get("tls_cert"), tls_key=get("tls_key"),
                           tls_server_name=get("tls_server_name"), api_key=api_key or None)
