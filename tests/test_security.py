"""Security of the gRPC links (issue 7), through real processes on loopback with certificates made here:

- TLS: a mutual-TLS cluster (scheduler <-> simulated worker, worker -> scheduler registration) serves a
  client holding the CA and a client certificate; plaintext clients, clients without a certificate and
  clients that do not trust the CA are refused;
- mutual TLS between the services: a worker whose certificate is not signed by the CA cannot register,
  and an address registered on its behalf (with valid credentials) is never sent a plan;
- the registration secret: missing or wrong -> UNAUTHENTICATED (Register and Deregister), right -> the
  worker is registered and serves;
- client API keys: missing, malformed or wrong -> UNAUTHENTICATED on Generate / GetModelInfo / Tokenize;
  the right key works; health and reflection stay open; the gateway reaches the scheduler with its
  `--scheduler-tls-*` certificate and `--scheduler-api-key`;
- services refuse to start without TLS material and without --plaintext (exit code 2 and a message).

One module-scoped cluster; every wait is bounded.
"""
from __future__ import annotations


from collections.abc import Callable
import functools
import importlib.util
import os
from pathlib import Path
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client import Client
from client.channel import ChannelSecurity, create_channel
from client.launcher import ClusterTLS, LocalCluster, Process, free_port
from common import security
from protos import membership_pb2 as mpb
from protos import membership_pb2_grpc
from tests import sim_cluster

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 30.0
CALL_S = 10.0
API_KEY = "sk-test-0123456789abcdef"
SECRET = b"registration-secret-0123456789abcdef"
SIM_ARGS = ["--base-ms", "1", "--num-blocks", "256", "--block-size", "16", "--log-format", "text"]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _make_certs():
    spec = importlib.util.spec_from_file_location("make_certs", REPO / "scripts" / "make_certs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the bound of this module's functional waits
wait_for = functools.partial(sim_cluster.wait_for, timeout=WAIT_S)


def stop(popen: subprocess.Popen) -> None:
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(15)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """`good`: the cluster's CA and its certificate for 127.0.0.1; `rogue`: another CA and a certificate
    of it for the same names (what an unknown pod could make itself)."""
    make = _make_certs()
    root = tmp_path_factory.mktemp("pki")
    names = ["127.0.0.1", "localhost"]
    return {"good": make.write(root / "good", names), "rogue": make.write(root / "rogue", names)}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("secrets")
    paths = {"secret": root / "registration", "wrong_secret": root / "wrong", "keys": root / "api-keys"}
    paths["secret"].write_bytes(SECRET + b"\n")  # a mounted Secret's final newline is not part of it
    paths["wrong_secret"].write_bytes(b"not-the-registration-secret\n")
    paths["keys"].write_text(f"# client keys\n{API_KEY}\nsk-other-key-abcdef\n")
    return paths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from bench.common import write_config_only

    return write_config_only("qwen3-tiny", tmp_path_factory.mktemp("sec-model") / "qwen3-tiny")


@pytest.fixture(scope="module")
def cluster(model_dir, pki, files, tmp_path_factory):
    """Mutual TLS everywhere, a registration secret, API keys; one simulated worker that registers."""
    good = pki["good"]
    tls = ClusterTLS(ca=good["ca.crt"], cert=good["tls.crt"], key=good["tls.key"])
    c = LocalCluster(model_dir, worker_command="simulate", register=True, tls=tls,
                     worker_args=[*SIM_ARGS, "--registration-secret-file", str(files["secret"])],
                     scheduler_args=["--log-format", "text", "--registration-secret-file", str(files["secret"]),
                                     "--api-key-file", str(files["keys"]), "--reconnect-timeout", "3"],
                     log_dir=tmp_path_factory.mktemp("sec-cluster"))
    c.start(timeout=120)
    yield c
    c.stop()


def client(c: LocalCluster, **overrides) -> Client:
    kwargs = {**c.security.kwargs(), "api_key": API_KEY, **overrides}
    return Client(c.address, timeout=CALL_S, **kwargs)


def worker_addresses(c: LocalCluster) -> list[str]:
    with client(c) as cl:
        return [w["address"] for w in cl.model_info()["workers"]]


def membership_stub(c: LocalCluster, pem: dict[str, Path]):
    channel = create_channel(c.address, ChannelSecurity(tls_ca=pem["ca.crt"], tls_cert=pem["tls.crt"],
                                                        tls_key=pem["tls.key"]))
    return channel, membership_pb2_grpc.MembershipStub(channel)


@pytest.fixture(scope="module")
def intruders(cluster: LocalCluster, pki, files) -> dict[str, Process]:
    """Two simulated workers that try to register: one with a certificate of another CA (and the right
    secret), one with the cluster's certificate and a wrong secret."""
    rogue = pki["rogue"]
    started = {
        "foreign_cert": cluster.start_worker(extra=["--tls-cert", str(rogue["tls.crt"]), "--tls-key",
                                                    str(rogue["tls.key"]), "--tls-ca", str(rogue["ca.crt"]),
                                                    "--registration-secret-file", str(files["secret"])]),
        "wrong_secret": cluster.start_worker(extra=["--registration-secret-file", str(files["wrong_secret"])]),
    }
    for proc in started.values():  # each has tried at least once and been refused
        wait_for(f"{proc.name} refused", lambda p=proc: "registering with the scheduler" in p.tail(50)
                 or p.popen.poll() is not None)
        assert proc.popen.poll() is None, proc.tail()
    yield started
    for proc in started.values():
        proc.popen.terminate()
        proc.popen.wait(15)


def _port(proc: Process) -> int:
    return int(proc.name.rsplit("-", 1)[1])


# ---- TLS -----------------------------------------------------------------------------------------


def test_tls_cluster_serves_a_client_with_the_ca(cluster: LocalCluster):
    with client(cluster) as c:
        (completion,) = c.complete("Hello over TLS", max_tokens=6, temperature=0.0, ignore_eos=True)
        assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
        info = c.model_info()
    # The worker registered over mutual TLS with the secret, and serves.
    assert info["num_workers"] == 1 and len(info["workers"]) == 1


def test_plaintext_and_unverified_clients_are_refused(cluster: LocalCluster, pki):
    rogue = pki["rogue"]
    attempts = {
        "plaintext": {"tls": False, "tls_ca": None, "tls_cert": None, "tls_key": None},
        "no client certificate": {"tls_cert": None, "tls_key": None},
        "client certificate of another CA": {"tls_cert": rogue["tls.crt"], "tls_key": rogue["tls.key"]},
        "does not trust the scheduler": {"tls_ca": rogue["ca.crt"]},
    }
    for what, overrides in attempts.items():
        with client(cluster, **overrides) as c:
            started = time.monotonic()
            error = rpc_error(lambda: c.model_info(timeout=5))
            assert error.code() == UNAVAILABLE, (what, error)
            assert time.monotonic() - started < 5, f"{what}: refused only by the deadline"
    with client(cluster) as c:  # and the scheduler is unharmed
        assert c.health() == "SERVING"


# ---- workers: mutual TLS and the registration secret ---------------------------------------------


def test_worker_with_a_foreign_certificate_cannot_register(cluster: LocalCluster, intruders):
    foreign = intruders["foreign_cert"]
    assert f"127.0.0.1:{_port(foreign)}" not in worker_addresses(cluster)
    assert "execute stream opened" not in foreign.tail(200), "the foreign worker was sent plans"
    assert len(worker_addresses(cluster)) == 1
    with client(cluster) as c:  # traffic goes on, to the authorised worker only
        for i in range(3):
            assert c.complete(f"request {i}", max_tokens=3)[0].finish_reason is not None
    assert "execute stream opened" not in foreign.tail(200)


def test_an_address_without_a_ca_certificate_gets_no_plans(cluster: LocalCluster, intruders, pki):
    """Registering the foreign worker's address with valid credentials (a CA certificate and the secret):
    the scheduler cannot verify that worker's certificate, so it never drives it."""
    foreign = intruders["foreign_cert"]
    address = f"127.0.0.1:{_port(foreign)}"
    channel, stub = membership_stub(cluster, pki["good"])
    with channel:
        error = rpc_error(lambda: stub.Register(mpb.RegisterRequest(address=address, worker_id="spoof"),
                                                timeout=CALL_S, metadata=security.registration_metadata(SECRET)))
    assert error.code() == UNAVAILABLE and "cannot reach" in error.details(), error
    assert address not in worker_addresses(cluster)
    assert "execute stream opened" not in foreign.tail(200)


def test_registration_secret(cluster: LocalCluster, intruders, pki):
    wrong = intruders["wrong_secret"]
    assert "UNAUTHENTICATED" in wrong.tail(50) and "wrong registration secret" in wrong.tail(50)
    assert f"127.0.0.1:{_port(wrong)}" not in worker_addresses(cluster)
    assert "execute stream opened" not in wrong.tail(200)

    (member,) = worker_addresses(cluster)
    channel, stub = membership_stub(cluster, pki["good"])
    with channel:
        for metadata, reason in (((), "no registration secret"),
                                 (security.registration_metadata(b"guess"), "wrong registration secret")):
            for call in (lambda: stub.Register(mpb.RegisterRequest(address=f"127.0.0.1:{_port(wrong)}"),
                                               timeout=CALL_S, metadata=metadata),
                         lambda: stub.Deregister(mpb.DeregisterRequest(address=member, grace_s=0),
                                                 timeout=CALL_S, metadata=metadata)):
                error = rpc_error(call)
                assert error.code() == UNAUTHENTICATED and reason in error.details(), error
        # The right secret: the registered worker is known (and nothing was drained by the refused calls).
        reply = stub.Register(mpb.RegisterRequest(address=member), timeout=CALL_S,
                              metadata=security.registration_metadata(SECRET))
        assert reply.already_member
    assert worker_addresses(cluster) == [member]
    with client(cluster) as c:
        assert c.complete("still serving", max_tokens=2)[0].finish_reason is not None


def test_registration_policy_matrix():
    ok = security.registration_metadata(SECRET)
    bad = security.registration_metadata(b"x" * len(SECRET))
    for transport in (security.MUTUAL_TLS, security.TLS, security.PLAINTEXT):
        with_secret = security.RegistrationPolicy(transport, SECRET)
        assert with_secret.refusal(ok) is None
        assert with_secret.refusal(bad) == "wrong registration secret"
        assert "no registration secret" in with_secret.refusal(())
    assert security.RegistrationPolicy(security.MUTUAL_TLS).refusal(()) is None  # the handshake authenticated
    assert security.RegistrationPolicy(security.PLAINTEXT).refusal(()) is None  # explicit local demo
    assert "takes no registrations" in security.RegistrationPolicy(security.TLS).refusal(ok)


# ---- client API keys -----------------------------------------------------------------------------


def test_api_keys(cluster: LocalCluster):
    for api_key, reason in ((None, "missing API key"), ("sk-wrong", "invalid API key")):
        with client(cluster, api_key=api_key) as c:
            for call in (lambda: c.complete("Hi", max_tokens=2), c.model_info, lambda: c.tokenize("Hi")):
                error = rpc_error(call)
                assert error.code() == UNAUTHENTICATED and reason in error.details(), (api_key, error)
            # Probes need no key.
            assert c.health() == "SERVING" and c.health("splitserve.v1.Generation") == "SERVING"
    with client(cluster, api_key=None, metadata=[("authorization", f"Basic {API_KEY}")]) as c:
        assert rpc_error(c.model_info).code() == UNAUTHENTICATED
    with client(cluster, api_key="sk-other-key-abcdef") as c:  # any key of the file
        assert c.tokenize("Hi") and c.model_info()["num_workers"] == 1
        assert c.complete("Hi", max_tokens=2)[0].finish_reason is not None
    # Reflection stays open too.
    with create_channel(cluster.address, cluster.security) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=CALL_S)
        names = {s.name for s in reply.list_services_response.service}
        assert "splitserve.v1.Generation" in names
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_S)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_api_key_check_is_exact():
    keys = security.ApiKeys(["sk-a", "sk-b"])
    assert keys.refusal([("authorization", "Bearer sk-b")]) is None
    assert keys.refusal([("authorization", "bearer  sk-a ")]) is None
    assert keys.refusal([("authorization", "Bearer sk-")]) == "invalid API key"
    assert keys.refusal([("authorization", "Bearer sk-ab")]) == "invalid API key"
    assert "malformed" in keys.refusal([("authorization", "sk-a")])
    assert "missing" in keys.refusal([])
    assert not security.ApiKeys([])


def test_cli_over_mutual_tls_with_a_key(cluster: LocalCluster, capsys):
    """The probes' command (`splitserve health` with the pod's certificate) and a generation with a key."""
    from client.cli import main

    tls = cluster.tls
    flags = ["--address", cluster.address, "--tls-ca", str(tls.ca), "--tls-cert", str(tls.cert),
             "--tls-key", str(tls.key), "--timeout", str(CALL_S)]
    assert main(["health", *flags, "--service="]) == 0
    assert main(["health", *flags]) == 0 and capsys.readouterr().out == "SERVING\nSERVING\n"
    assert main(["generate", *flags, "--api-key", API_KEY, "--max-tokens", "3", "Hi"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["info", *flags, "--api-key", "sk-wrong"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["health", "--address", cluster.address, "--tls-ca", str(tls.ca), "--timeout", "5"]) == 2
    assert "UNAVAILABLE" in capsys.readouterr().err  # no client certificate: refused by mutual TLS


# ---- certificate rotation ---------------------------------------------------------------------------


def test_certificates_rotate_without_a_restart(model_dir, pki, tmp_path):
    """cert-manager renews a mounted Secret in place: the scheduler serves new connections with the new
    certificate, without a restart; files that do not load keep the current one."""
    good, rogue = pki["good"], pki["rogue"]
    live = tmp_path / "tls"
    live.mkdir()

    def install(pem: dict[str, Path]) -> None:  # as the kubelet does: new files, then an atomic swap
        for name in ("tls.crt", "tls.key"):
            staged = live / f".{name}.new"
            staged.write_bytes(pem[name].read_bytes())
            os.replace(staged, live / name)

    def serving(ca: dict[str, Path]) -> bool:
        """A new connection that trusts only `ca` gets a health answer."""
        channel = create_channel(f"127.0.0.1:{port}", ChannelSecurity(tls_ca=ca["ca.crt"]))
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
            return True
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    install(good)
    port = free_port()
    log = tmp_path / "scheduler.log"
    with open(log, "wb") as out:
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "scheduler_svc.cli", "--model", str(model_dir), "--host", "127.0.0.1", "--port",
             str(port), "--tls-cert", str(live / "tls.crt"), "--tls-key", str(live / "tls.key"), "--log-format",
             "text"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
    try:
        wait_for("the scheduler serving its first certificate", lambda: serving(good))
        assert not serving(rogue)
        install(rogue)  # another CA's certificate: only clients trusting that CA verify it now
        wait_for("the rotated certificate served", lambda: serving(rogue))
        assert not serving(good)
        (live / "tls.key").write_bytes(b"half written\n")
        assert serving(rogue) and not serving(good)
        assert "do not load" in log.read_text() and scheduler.poll() is None
    finally:
        stop(scheduler)


def test_tls_config_reloads_changed_files_only(pki, tmp_path):
    good, rogue = pki["good"], pki["rogue"]
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(good["tls.crt"].read_bytes())
    key.write_bytes(good["tls.key"].read_bytes())
    tls = security.TLSConfig(cert, key, good["ca.crt"])
    first = tls.material()
    assert tls.material() is first and tls.version == 0  # unchanged files: not read again
    for path, pem in ((cert, rogue["tls.crt"]), (key, rogue["tls.key"])):
        staged = path.with_suffix(".new")
        staged.write_bytes(pem.read_bytes())
        os.replace(staged, path)
    rotated = tls.material()
    assert rotated.cert_chain == rogue["tls.crt"].read_bytes() and tls.version == 1
    key.write_bytes(good["tls.key"].read_bytes())  # a key that does not match the certificate
    assert tls.material() is rotated and tls.version == 1
    assert "private key" not in repr(tls) and "BEGIN" not in repr(rotated)


# ---- the gateway as a client of a TLS scheduler -----------------------------------------------------


def test_gateway_reaches_the_scheduler_over_mutual_tls_with_its_key(cluster: LocalCluster, tmp_path):
    key_file = tmp_path / "scheduler-key"
    key_file.write_text(API_KEY + "\n")
    tls = cluster.tls
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("SPLITSERVE_API_KEY", "SPLITSERVE_SCHEDULER_API_KEY")}
    with open(tmp_path / "gateway.log", "wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "--scheduler", cluster.address, "--host", "127.0.0.1", "--port",
             str(port), "--scheduler-tls-ca", str(tls.ca), "--scheduler-tls-cert", str(tls.cert),
             "--scheduler-tls-key", str(tls.key), "--scheduler-api-key-file", str(key_file), "--no-access-log"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for("the gateway healthy", healthy, timeout=60)  # health over mutual TLS
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=CALL_S)
        assert reply.status_code == 200, reply.text  # model info and generation with the key
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        stop(gateway)


# ---- refusing to start ---------------------------------------------------------------------------


def test_services_refuse_to_start_without_tls_or_plaintext(model_dir, pki, capsys):
    done = subprocess.run([sys.executable, "-m", "scheduler_svc.cli", "--model", str(model_dir), "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "no TLS material" in done.stderr and "--plaintext" in done.stderr and "Traceback" not in done.stderr

    from scheduler_svc.cli import main as scheduler_main
    from worker_svc.cli import main as worker_main

    good, rogue = pki["good"], pki["rogue"]
    cases = [
        ([], "no TLS material"),
        (["--tls-cert", str(good["tls.crt"])], "--tls-cert given without --tls-key"),
        (["--plaintext", "--tls-ca", str(good["ca.crt"])], "--plaintext contradicts --tls-ca"),
        (["--tls-cert", str(good["tls.crt"]), "--tls-key", str(rogue["tls.key"])], "unencrypted private key"),
        (["--tls-cert", str(good["tls.crt"]), "--tls-key", str(good["tls.key"]), "--tls-ca",
          str(good["tls.key"])], "not a PEM CA bundle"),
        (["--tls-cert", str(good["tls.crt"]) + ".missing", "--tls-key", str(good["tls.key"])],
         "No such file or directory"),
    ]
    for extra, message in cases:
        for main, argv in ((worker_main, ["simulate", "--model", str(model_dir)]),
                           (worker_main, ["serve", "--model", str(model_dir)]),
                           (scheduler_main, ["--model", str(model_dir)])):
            with pytest.raises(SystemExit) as info:
                main([*argv, *extra])
            assert info.value.code == 2, (argv, extra)
            assert message in capsys.readouterr().err, (argv, extra, message)


def test_client_security_arguments(pki):
    good = pki["good"]
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        Client("127.0.0.1:1", tls_cert=good["tls.crt"])
    with pytest.raises(ValueError, match="printable ASCII"):
        Client("127.0.0.1:1", api_key="two words")
    c = Client("127.0.0.1:1", api_key=API_KEY, tls_ca=good["ca.crt"].read_bytes())
    assert c.metadata == (("authorization", f"Bearer {API_KEY}"),) and API_KEY not in repr(c.security)
    c.close()
