"""Starts a scheduler and worker processes on this machine (for `splitserve up`, tests and
benchmarks) and stops them again. Only processes: nothing of the services is imported.

Every process listens on 127.0.0.1 only, and runs with --plaintext (a local demo) unless the cluster is
given TLS material (`tls=ClusterTLS(...)`: then every link is mutual TLS with those files)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.channel import ChannelSecurity, create_channel
from common.lifetime import PARENT_PID_ENV
from common.util import free_port

PUBLIC_SERVICE = "splitserve.v1.Generation"


def health_status(address: str, service: str = "", timeout: float = 2.0,
                  security: ChannelSecurity | None = None) -> str:
    with create_channel(address, security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass(frozen=True)
class ClusterTLS:
    """PEM files for every process of a LocalCluster (and its clients): the CA verifies all of them, and
    the one certificate must name 127.0.0.1 (an IP subject alternative name)."""
    ca: Path
    cert: Path
    key: Path

    def args(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]

    def client(self, api_key: str | None = None) -> ChannelSecurity:
        return ChannelSecurity(tls_ca=self.ca, tls_cert=self.cert, tls_key=self.key, api_key=api_key)


@dataclass
class LocalCluster:
    """A scheduler over `num_workers` single-process workers, all on 127.0.0.1. With `register`, the
    workers register themselves with the scheduler (`--scheduler`) instead of being listed (`--worker`)."""
    model_dir: Path
    num_workers: int = 1
    device: str = "cpu"
    worker_command: str = "serve"  # or "simulate": the simulated worker
    worker_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    register: bool = False
    tls: ClusterTLS | None = None  # None: every process runs --plaintext (loopback only)
    port: int = 0
    worker_ports: list[int] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def security(self) -> ChannelSecurity:
        """How a client reaches this cluster's scheduler (plaintext, or the cluster's certificate)."""
        return self.tls.client() if self.tls is not None else ChannelSecurity()

    def _security_args(self) -> list[str]:
        return self.tls.args() if self.tls is not None else ["--plaintext"]

    def _spawn(self, name: str, args: list[str]) -> Process:
        assert self.log_dir is not None
        log_path = self.log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())}  # ends with this process
        with open(log_path, "ab") as log:
            popen = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        proc = Process(name, popen, log_path)
        self.processes.append(proc)
        return proc

    def start_worker(self, port: int | None = None, extra: list[str] | None = None) -> Process:
        port = port or free_port()
        if port not in self.worker_ports:
            self.worker_ports.append(port)
        membership = ["--scheduler", self.address] if self.register else []
        device = ["--device", self.device] if self.worker_command == "serve" else []  # a simulated worker has none
        return self._spawn(f"worker-{port}", ["-m", "worker_svc.cli", self.worker_command, "--model", str(self.model_dir),
                                              "--host", "127.0.0.1", "--port", str(port), *device,
                                              *self._security_args(), *membership, *self.worker_args,
                                              *(extra or [])])

    def start_scheduler(self, extra: list[str] | None = None) -> Process:
        """The scheduler process (again, on the same port, after one died: registered workers come back)."""
        workers = [] if self.register else [a for p in self.worker_ports for a in ("--worker", f"127.0.0.1:{p}")]
        return self._spawn("scheduler", ["-m", "scheduler_svc.cli", "--model", str(self.model_dir), "--host",
                                         "127.0.0.1", "--port", str(self.port), *workers, *self._security_args(),
                                         *self.scheduler_args, *(extra or [])])

    def start(self, timeout: float = 300.0) -> "LocalCluster":
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="splitserve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        ports = self.worker_ports or [free_port() for _ in range(self.num_workers)]
        if self.register:
            self.start_scheduler()
        for port in ports:
            self.start_worker(port)
        if not self.register:
            self.start_scheduler()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()  # no orphans holding ports or GPU memory
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.processes:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            if health_status(self.address, PUBLIC_SERVICE, security=self.security) == "SERVING":
                return
            time.sleep(0.05)
        raise TimeoutError(f"scheduler not serving after {timeout:.0f} s; logs in {self.log_dir}")

    def exited(self) -> Process | None:
        return next((p for p in self.processes if p.popen.poll() is not None), None)

    def stop(self, timeout: float = 15.0) -> None:
        for proc in reversed(self.processes):  # scheduler first: it drains, then workers go
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
                try:
                    proc.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait()
        self.processes.clear()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
