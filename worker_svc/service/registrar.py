"""A worker's membership with its scheduler (`--scheduler HOST:PORT`, protos/membership.proto).

The registrar thread registers the worker whenever no scheduler drives its Execute stream: at start-up
(retrying with exponential backoff until the scheduler is up) and again when the stream ends (the
scheduler restarted, died, or gave up on this worker). Register returns once the scheduler has connected,
so a worker that stays undriven after a successful Register registers again.

On SIGTERM the worker drains: `deregister(grace)` refuses new schedulers, then calls Deregister, which
returns once the scheduler has let the running requests finish within `grace` seconds, moved what
remained to other workers by recompute, and closed the stream. Only then does the worker stop.
"""
from __future__ import annotations

import logging
import random
import socket
import threading

import grpc

from common import security
from common.security import TLSConfig
from protos import membership_pb2 as mpb
from protos import membership_pb2_grpc

log = logging.getLogger("splitserve.worker")
BACKOFF_MIN_S = 0.5
REGISTER_TIMEOUT_S = 30.0  # one Register call (the scheduler connects back within it)
DRIVEN_WAIT_S = 10.0  # after a successful Register, how long to wait for the scheduler's stream


def advertise_address(host: str, port: int) -> str:
    """Default --advertise-address: the listening address, or this host's name when listening on all."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


class Registrar:
    def __init__(self, service, scheduler: str, address: str, backoff_max: float = 10.0, *,
                 tls: TLSConfig | None, secret: bytes | None = None):
        """service: the worker's WorkerService (worker_svc.service.server). tls: the worker's own material (it verifies
        the scheduler with the CA and presents its certificate); None: plaintext. secret: the registration
        secret, sent with every Register and Deregister."""
        self.service = service
        self.scheduler, self.address = scheduler, address
        self.backoff_max = max(BACKOFF_MIN_S, backoff_max)
        self.tls = tls
        self.metadata = security.registration_metadata(secret)
        self._open_channel()
        self.scheduler_id: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="registrar")

    def _open_channel(self) -> None:
        self.channel = security.channel(self.scheduler, self.tls)
        self.stub = membership_pb2_grpc.MembershipStub(self.channel)
        self._tls_version = self.tls.version if self.tls is not None else 0

    def _fresh_channel(self) -> None:
        """A new channel when the certificate rotated: an open one would keep presenting the old."""
        if self.tls is not None:
            self.tls.material()  # looks at the files
            if self.tls.version != self._tls_version:
                self.channel.close()
                self._open_channel()

    def start(self) -> "Registrar":
        self._thread.start()
        return self

    def _run(self) -> None:
        delay = BACKOFF_MIN_S
        failures = 0
        while not self._stop.is_set():
            if not self.service.wait_driven(False, 1.0):
                continue  # a scheduler drives this worker
            info = self.service.runner.describe()
            self._fresh_channel()
            try:
                reply = self.stub.Register(mpb.RegisterRequest(address=self.address, worker_id=info.worker_id,
                                                               epoch=info.epoch), timeout=REGISTER_TIMEOUT_S,
                                           metadata=self.metadata)
            except grpc.RpcError as e:
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    refused = e.code() == grpc.StatusCode.UNAUTHENTICATED
                    log.log(logging.ERROR if refused else logging.INFO,
                            "registering with the scheduler at %s failed (%s: %s)%s; retrying with backoff",
                            self.scheduler, e.code().name, e.details(),
                            " (check --registration-secret-file)" if refused else "")
                self._stop.wait(delay * random.uniform(0.8, 1.2))
                delay = min(2 * delay, self.backoff_max)
                continue
            delay, failures = BACKOFF_MIN_S, 0
            if reply.scheduler_id != self.scheduler_id:
                log.info("registered as %s with the scheduler at %s (scheduler id %s)", self.address,
                         self.scheduler, reply.scheduler_id)
                self.scheduler_id = reply.scheduler_id
            self.service.wait_driven(True, DRIVEN_WAIT_S)

    def deregister(self, grace: float) -> bool:
        """Drains: stops registering, refuses new schedulers, and hands the worker's requests back (blocks
        up to about grace seconds). False when the scheduler could not be told."""
        self._stop.set()
        self.service.drain()
        info = self.service.runner.describe()
        try:
            reply = self.stub.Deregister(mpb.DeregisterRequest(address=self.address, worker_id=info.worker_id,
                                                               grace_s=grace), timeout=grace + 30.0,
                                             metadata=self.metadata)
        except grpc.RpcError as e:
            log.warning("deregistering from the scheduler at %s failed (%s: %s)", self.scheduler, e.code().name,
                        e.details())
            return False
        finally:
            self._thread.join(timeout=2.0)
        log.info("deregistered from the scheduler at %s: %d request(s) moved to other workers", self.scheduler,
                 reply.moved)
        return True

    def close(self) -> None:
        self._stop.set()
        self.channel.close()
