"""Transport security and authentication of the two services (scheduler and worker).

Flags, the same on `splitserve-scheduler` and `splitserve-worker serve|simulate`:

  --tls-cert PATH, --tls-key PATH   this process's certificate chain and private key (PEM). It serves TLS
                                    with them, and presents them as its client certificate when it calls
                                    the other service (scheduler -> worker, worker -> scheduler).
  --tls-ca PATH                     CA bundle that verifies the peers this process calls and, on its own
                                    port, REQUIRES every caller to present a certificate signed by it:
                                    mutual TLS. (Scheduler: `--tls-client-auth none` keeps the CA for the
                                    workers only, for public clients without certificates.)
  --plaintext                       no TLS at all; the explicit opt-out for a local demo on loopback.
                                    The TLS files may be replaced while the process runs (rotation):
                                    see TLSConfig.
                                    Without TLS material and without it a service refuses to start.
  --registration-secret-file PATH   a shared secret ($SPLITSERVE_REGISTRATION_SECRET): the worker sends it
                                    with Register/Deregister (metadata `splitserve-registration-secret-bin`),
                                    the scheduler compares it in constant time.

Scheduler only: `--api-key KEY` (repeatable), `--api-key-file PATH` (one key a line), $SPLITSERVE_API_KEYS
(comma-separated). With any key, the Generation service (Generate, GetModelInfo, Tokenize) requires the
metadata `authorization: Bearer KEY`; health and reflection stay open for probes.

Who may register a worker (Register / Deregister on the scheduler):

  scheduler transport              no secret configured            secret configured
  mutual TLS (--tls-ca)            any caller: the TLS handshake   a CA-signed certificate AND the secret
                                   already required a certificate
                                   signed by the CA
  TLS, no client certificates      nobody (UNAUTHENTICATED): only  the secret
  (--tls-client-auth none)         the static --worker list
  plaintext (--plaintext)          anybody (local demo only)       the secret (sent in clear: demo only)

Whoever registers, the scheduler then connects to the address given, verifying that worker's server
certificate against --tls-ca (with TLS): an address held by a process without a certificate of the CA is
never sent a plan. Refusals are UNAUTHENTICATED, and nothing is routed to the address.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.util import RECONNECT_OPTIONS

log = logging.getLogger("splitserve.security")

REGISTRATION_SECRET_ENV = "SPLITSERVE_REGISTRATION_SECRET"
REGISTRATION_SECRET_METADATA = "splitserve-registration-secret-bin"  # -bin: any bytes
API_KEYS_ENV = "SPLITSERVE_API_KEYS"
AUTHORIZATION_METADATA = "authorization"

PLAINTEXT = "plaintext"
TLS = "tls"  # server-side TLS only: callers are not authenticated by certificate
MUTUAL_TLS = "mutual TLS"


class SecurityConfigError(ValueError):
    """Missing, unreadable or contradictory security settings: the service must not start."""


# ---- TLS ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSMaterial:
    cert_chain: bytes
    private_key: bytes
    ca: bytes | None

    def __repr__(self) -> str:  # never the key in a log line
        return "TLSMaterial(...)"


def _load_material(cert: Path, key: Path, ca: Path | None) -> TLSMaterial:
    """Reads and checks the PEM files (the key matches the certificate, the CA bundle loads).
    Raises SecurityConfigError."""
    material = TLSMaterial(_read(cert, "--tls-cert"), _read(key, "--tls-key"),
                           _read(ca, "--tls-ca") if ca is not None else None)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key, password=b"")
    except (ssl.SSLError, ValueError) as e:
        raise SecurityConfigError(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate chain and its "
                                  f"unencrypted private key ({e})") from None
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, ValueError) as e:
            raise SecurityConfigError(f"--tls-ca {ca}: not a PEM CA bundle ({e})") from None
    return material


class TLSConfig:
    """The TLS files of one service process, and what they hold.

    Certificates rotate without a restart (cert-manager renews a mounted Secret in place): before each
    connection this process accepts or opens, the files are looked at again (a stat each) and re-read when
    they changed. Files that do not load (a rotation half written) are logged and the previous material
    kept; connections already open keep the certificate they were made with."""

    def __init__(self, cert: Path, key: Path, ca: Path | None = None, require_client_auth: bool = True):
        self.paths = (Path(cert), Path(key), Path(ca) if ca is not None else None)
        self.require_client_auth = require_client_auth  # with a CA, on our port (mutual TLS)
        self._lock = threading.Lock()
        self._material = _load_material(*self.paths)
        self._stamp = self._stat()
        self.version = 0  # +1 each time new material is loaded

    def __repr__(self) -> str:
        return f"TLSConfig(mode={self.mode!r})"

    @property
    def mutual(self) -> bool:
        return self.paths[2] is not None and self.require_client_auth

    @property
    def mode(self) -> str:
        return MUTUAL_TLS if self.mutual else TLS

    def _stat(self) -> tuple:
        stats = [os.stat(p) for p in self.paths if p is not None]  # follows the Secret's symlinks
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)

    def material(self) -> TLSMaterial:
        """The current material, re-read first when a file changed since the last look."""
        try:
            stamp = self._stat()
        except OSError:  # a file is being swapped: keep what we have
            return self._material
        with self._lock:
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._material = _load_material(*self.paths)
                except SecurityConfigError as e:
                    log.error("TLS files changed but do not load (%s); keeping the previous certificate", e)
                else:
                    self.version += 1
                    log.info("TLS certificate re-read from %s (rotation %d)", self.paths[0], self.version)
            return self._material

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that gRPC asks before each handshake whether the certificate changed."""
        def configuration(m: TLSMaterial):
            return grpc.ssl_server_certificate_configuration([(m.private_key, m.cert_chain)],
                                                             root_certificates=m.ca if self.mutual else None)

        served = self.version

        def fetch():
            nonlocal served
            material = self.material()
            if self.version == served:
                return None  # gRPC keeps the configuration it has
            served = self.version
            return configuration(material)

        return grpc.dynamic_ssl_server_credentials(configuration(self.material()), fetch,
                                                   require_client_authentication=self.mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """To call the other service: verify it with the CA (the system's roots without one), and present
        this process's certificate. Make them for each new channel: they hold the material of now."""
        m = self.material()
        return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.private_key,
                                            certificate_chain=m.cert_chain)


def transport(tls: TLSConfig | None) -> str:
    return PLAINTEXT if tls is None else tls.mode


def add_tls_arguments(parser: argparse.ArgumentParser, *, client_auth_option: bool = False) -> None:
    g = parser.add_argument_group(
        "transport security", "TLS on every gRPC link this process serves or opens. Without --tls-cert and "
                              "--tls-key the process refuses to start, unless --plaintext is given.")
    g.add_argument("--tls-cert", type=Path, metavar="PATH",
                   help="this process's certificate chain (PEM): served, and presented as the client certificate "
                        "when calling the other service")
    g.add_argument("--tls-key", type=Path, metavar="PATH", help="the private key of --tls-cert (PEM, unencrypted)")
    g.add_argument("--tls-ca", type=Path, metavar="PATH",
                   help="CA bundle (PEM) that verifies peers; callers of this process must then present a "
                        "certificate signed by it (mutual TLS)")
    if client_auth_option:
        g.add_argument("--tls-client-auth", choices=["require", "none"], default="require",
                       help="with --tls-ca: `require` (default) a CA-signed client certificate from every caller, "
                            "or `none`: the CA verifies the workers only, and clients need no certificate "
                            "(public clients, with API keys; registration then needs a secret)")
    g.add_argument("--plaintext", action="store_true",
                   help="no TLS: no encryption, no peer authentication. Only for a local demo on loopback")


def _read(path: Path, flag: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"{flag} {path}: {e.strerror or e}") from None
    if not data.strip():
        raise SecurityConfigError(f"{flag} {path}: the file is empty")
    return data


def tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    """The process's TLS material from its flags, checked (the key matches the certificate, the CA bundle
    loads); None with --plaintext. Raises SecurityConfigError."""
    given = [f"--tls-{n}" for n in ("cert", "key", "ca") if getattr(args, f"tls_{n}", None) is not None]
    if args.plaintext:
        if given:
            raise SecurityConfigError(f"--plaintext contradicts {', '.join(given)}: choose TLS or plaintext")
        return None
    if args.tls_cert is None or args.tls_key is None:
        missing = " and ".join(f for f, v in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)) if v is None)
        if given:
            raise SecurityConfigError(f"{', '.join(given)} given without {missing}")
        raise SecurityConfigError(
            "no TLS material: give --tls-cert and --tls-key (and --tls-ca to verify peers and require their "
            "certificates: mutual TLS), or --plaintext to run without encryption or authentication "
            "(a local demo on loopback only)")
    client_auth = getattr(args, "tls_client_auth", "require") == "require"
    return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, require_client_auth=client_auth)


def add_port(server, address: str, tls: TLSConfig | None) -> int:
    """Binds `address` on a sync or aio server, with TLS or (tls None: --plaintext) without; returns the
    port bound. Raises OSError when it cannot listen there."""
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.server_credentials())
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound


def channel(address: str, tls: TLSConfig | None, options: list | None = None) -> grpc.Channel:
    """A blocking channel to the other service, secured like this process."""
    options = [*RECONNECT_OPTIONS, *(options or [])]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


# ---- registration secret ----------------------------------------------------------------------------


def add_registration_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registration-secret-file", type=Path, metavar="PATH",
                        help=f"shared secret that authorises worker registration (e.g. a mounted Secret; default "
                             f"${REGISTRATION_SECRET_ENV}); the scheduler and its workers must have the same")


def registration_secret_from_args(args: argparse.Namespace) -> bytes | None:
    """The secret of --registration-secret-file, else of $SPLITSERVE_REGISTRATION_SECRET; surrounding
    whitespace (a file's final newline) is not part of it."""
    if args.registration_secret_file is not None:
        secret = _read(args.registration_secret_file, "--registration-secret-file").strip()
    else:
        secret = os.environ.get(REGISTRATION_SECRET_ENV, "").strip().encode()
        if not secret:
            return None
    if len(secret) < 16:
        log.warning("the registration secret has %d bytes: use at least 16 random ones", len(secret))
    return secret


def registration_metadata(secret: bytes | None) -> tuple[tuple[str, bytes], ...]:
    return ((REGISTRATION_SECRET_METADATA, secret),) if secret else ()


def _metadata_value(metadata: Iterable | None, key: str):
    for k, v in metadata or ():
        if k == key:
            return v
    return None


@dataclass(frozen=True, repr=False)
class RegistrationPolicy:
    """Who may call Register / Deregister on the scheduler (the matrix in this module's docstring)."""
    transport: str = PLAINTEXT
    secret: bytes | None = None

    def refusal(self, metadata: Iterable | None) -> str | None:
        """None when the call is authorised, else why not (for an UNAUTHENTICATED status)."""
        if self.secret is not None:
            given = _metadata_value(metadata, REGISTRATION_SECRET_METADATA)
            if isinstance(given, str):
                given = given.encode()
            if given is None:
                return "no registration secret: the worker needs the scheduler's --registration-secret-file"
            if not hmac.compare_digest(given, self.secret):
                return "wrong registration secret"
            return None
        if self.transport == TLS:
            return ("this scheduler takes no registrations: it has neither mutual TLS (--tls-ca) nor a "
                    "--registration-secret-file")
        return None  # mutual TLS: the handshake authenticated the caller; plaintext: an explicit demo

    def describe(self) -> str:
        if self.secret is not None:
            return f"registration needs the shared secret (over {self.transport})"
        return {MUTUAL_TLS: "registration needs a client certificate signed by the CA",
                TLS: "registration is off (no mutual TLS, no secret): only --worker addresses are driven",
                PLAINTEXT: "registration is OPEN to anybody who reaches the port (plaintext, no secret)"}[
            self.transport]


# ---- API keys ---------------------------------------------------------------------------------------


def add_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("client API keys", f"With any key (also from ${API_KEYS_ENV}, comma-separated), "
                                                     "the public API requires `authorization: Bearer KEY`; "
                                                     "health and reflection stay open")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY", help="an accepted key; repeatable")
    g.add_argument("--api-key-file", action="append", default=[], type=Path, metavar="PATH",
                   help="a file of accepted keys, one a line (`#` comments); repeatable")


def api_keys_from_args(args: argparse.Namespace) -> frozenset[str]:
    keys = [k.strip() for k in [*args.api_key, *os.environ.get(API_KEYS_ENV, "").split(",")]]
    for path in args.api_key_file:
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise SecurityConfigError(f"--api-key-file {path}: {getattr(e, 'strerror', None) or e}") from None
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise SecurityConfigError(f"--api-key-file {path}: no key in it")
        keys += found
    keys = [k for k in keys if k]
    for k in keys:
        if not k.isascii() or not k.isprintable() or " " in k:
            raise SecurityConfigError("an API key must be printable ASCII without spaces")
    return frozenset(keys)


class ApiKeys:
    """Accepted client keys, checked in constant time (digests compared with every key)."""

    def __init__(self, keys: Iterable[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def refusal(self, metadata: Iterable | None) -> str | None:
        value = _metadata_value(metadata, AUTHORIZATION_METADATA)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if not value:
            return "missing API key: send the metadata `authorization: Bearer KEY`"
        scheme, _, key = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "malformed authorization metadata: expected `Bearer KEY`"
        digest = hashlib.sha256(key.strip().encode()).digest()
        match = False
        for d in self._digests:
            match |= hmac.compare_digest(d, digest)
        return None if match else "invalid API key"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the protected services without a valid key (UNAUTHENTICATED), before any handler
    runs; other services (health, reflection, membership) pass."""

    def __init__(self, keys: ApiKeys, services: Iterable[str],
                 on_refused: Callable[[str], None] | None = None):
        self.keys = keys
        self.prefixes = tuple(f"/{s}/" for s in services)
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefixes):
            return handler
        reason = self.keys.refusal(handler_call_details.invocation_metadata)
        if reason is None:
            return handler
        if self.on_refused is not None:
            self.on_refused(handler_call_details.method)
        return _refusing_handler(handler, reason)


def _refusing_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover (an async generator, as the handler's kind wants)

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **codec)
