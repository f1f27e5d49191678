"""Fuzzing the public API: arbitrary GenerateRequest and TokenizeRequest messages (huge, negative, NaN,
infinite values, garbage unicode, random field combinations) sent to a real scheduler over two
simulated workers. The server never crashes or hangs (every call ends well within its bound), every
call ends OK or with a documented status, and no block leaks.

Hypothesis without per-example deadlines; generations stay tiny (small max_tokens where set, a short
model length); some calls carry a very short gRPC deadline so that DEADLINE_EXCEEDED paths run too.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random

import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import Client
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from tests.sim_cluster import WAIT_S, all_idle, config_only_model, start_simulated, wait_for

pytestmark = pytest.mark.timeout(600)

MAX_MODEL_LEN = 128
VOCAB = 151936
CALL_BOUND_S = 60.0  # a call that has not ended by then is a hang
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}

_ids = itertools.count()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = config_only_model(tmp_path_factory.mktemp("sim-model") / "qwen3-tiny")
    c = start_simulated(model, tmp_path_factory.mktemp("fuzz-logs"), num_workers=2,
                        worker_args=["--num-blocks", "32", "--block-size", "16", "--max-model-len",
                                     str(MAX_MODEL_LEN)],
                        scheduler_args=["--max-waiting", "64"])
    yield c
    c.stop()


# --- strategies: the public API's field types, with their whole ranges and then some ---------------------

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)
GARBAGE = st.text(max_size=40)  # any unicode but surrogates (which the client cannot even encode)
HUGE_TEXT = st.sampled_from(["a" * 70_000, "🙂" * 20_000, "\x00" * 100_000, "word " * 2_000])


token_id = st.one_of(st.integers(0, VOCAB - 1), INT32, st.sampled_from([-1, VOCAB, 151643, 151645]))
sane_id = st.integers(0, VOCAB - 1)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), GARBAGE)
sane_roles = st.sampled_from(["system", "user", "assistant", "tool"])


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """Half the examples are sane but for the odd field; the others take any value of each field's type."""
    wild = draw(st.booleans())

    def pick(sane, anything):
        if wild or draw(st.integers(0, 9)) == 0:
            return draw(st.one_of(sane, anything))
        return draw(sane)

    r = pb.GenerateRequest()
    if draw(st.booleans()):
        r.request_id = pick(st.text(max_size=20), st.text(min_size=250, max_size=300))
        if r.request_id and draw(st.booleans()):
            r.request_id += f"-{next(_ids)}"  # mostly unique; a reused id is ALREADY_EXISTS while in use
    kind = pick(st.sampled_from(["text", "token_ids", "chat"]), st.sampled_from(["none", "huge"]))
    if kind == "text":
        r.text = draw(GARBAGE)
    elif kind == "huge":
        r.text = draw(HUGE_TEXT)
    elif kind == "token_ids":
        r.token_ids.SetInParent()
        r.token_ids.ids.extend(pick(st.lists(sane_id, min_size=1, max_size=64),
                                    st.lists(token_id, max_size=2 * MAX_MODEL_LEN)))
    elif kind == "chat":
        r.chat.SetInParent()
        for role, content in pick(st.lists(st.tuples(sane_roles, GARBAGE), min_size=1, max_size=4),
                                  st.lists(st.tuples(roles, GARBAGE), max_size=6)):
            r.chat.messages.add(role=role, content=content)
        if draw(st.booleans()):
            r.chat.add_generation_prompt = draw(st.booleans())
        if draw(st.booleans()):
            r.chat.enable_thinking = draw(st.booleans())
    s = r.sampling
    for name, sane in (("temperature", st.floats(0, 2)), ("top_p", st.floats(0.01, 1)), ("min_p", st.floats(0, 1)),
                       ("repetition_penalty", st.floats(0.5, 2)), ("presence_penalty", st.floats(-2, 2)),
                       ("frequency_penalty", st.floats(-2, 2))):
        if draw(st.booleans()):
            setattr(s, name, pick(sane, FLOATS))
    if draw(st.booleans()):
        s.top_k = pick(st.integers(-1, 50), INT32)
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    t = r.stopping
    t.max_tokens = pick(st.integers(1, 6), UINT32)  # keeps most generations tiny
    if draw(st.booleans()):
        t.stop.extend(pick(st.lists(st.text(min_size=1, max_size=3), max_size=3),
                           st.lists(st.one_of(GARBAGE, st.text(min_size=250, max_size=260)), max_size=20)))
    if draw(st.booleans()):
        t.stop_token_ids.extend(pick(st.lists(sane_id, max_size=3), st.lists(token_id, max_size=70)))
    t.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        t.min_tokens = pick(st.integers(0, 2), UINT32)
    if draw(st.booleans()):
        r.logprobs = pick(st.integers(0, 5), UINT32)
    if draw(st.booleans()):
        r.n = pick(st.integers(1, 3), UINT32)
    if draw(st.booleans()):
        r.priority = pick(st.integers(-3, 3), INT32)
    if draw(st.booleans()):
        r.skip_special_tokens = draw(st.booleans())
    return r


@st.composite
def tokenize_requests(draw) -> pb.TokenizeRequest:
    r = pb.TokenizeRequest(add_special_tokens=draw(st.booleans()))
    kind = draw(st.sampled_from(["text", "chat", "none", "huge"]))
    if kind == "text":
        r.text = draw(GARBAGE)
    elif kind == "huge":
        r.text = draw(HUGE_TEXT)
    elif kind == "chat":
        r.chat.SetInParent()
        for role, content in draw(st.lists(st.tuples(roles, GARBAGE), max_size=4)):
            r.chat.messages.add(role=role, content=content)
    return r


# --- the test -----------------------------------------------------------------------------------------------


def _generate(stub, request: pb.GenerateRequest, timeout: float) -> tuple[grpc.StatusCode, list]:
    call = stub.Generate(request, timeout=timeout)
    responses = []
    try:
        for response in call:
            responses.append(response)
    except grpc.RpcError as e:
        return e.code(), responses
    return grpc.StatusCode.OK, responses


def test_arbitrary_requests_never_crash_hang_or_leak(cluster):
    statuses: dict[str, int] = {}
    with grpc.insecure_channel(cluster.address) as channel, Client(cluster.address, timeout=WAIT_S) as client:
        stub = pb_grpc.GenerationStub(channel)

        @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(request=generate_requests(), tokenize=tokenize_requests(),
               short_deadline=st.one_of(st.none(), st.none(), st.floats(0.001, 0.2)))
        def one(request, tokenize, short_deadline):
            code, responses = _generate(stub, request, short_deadline or CALL_BOUND_S)
            statuses[code.name] = statuses.get(code.name, 0) + 1
            allowed = DOCUMENTED | ({grpc.StatusCode.ALREADY_EXISTS} if request.request_id else set())
            assert code in allowed, (code, request)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                assert short_deadline is not None, f"a call hung for {CALL_BOUND_S} s: {request}"
            if code == grpc.StatusCode.OK:
                n = request.n if request.HasField("n") else 1
                finished = [r for r in responses if r.finish_reason]
                assert sorted(r.index for r in finished) == list(range(n)), request
                for r in finished:
                    tokens = sum(len(x.token_ids) for x in responses if x.index == r.index)
                    assert r.usage.completion_tokens == tokens
                    if request.stopping.HasField("max_tokens"):
                        assert tokens <= request.stopping.max_tokens
            try:
                stub.Tokenize(tokenize, timeout=CALL_BOUND_S)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), tokenize)
            assert cluster.exited() is None, "a service process died"

        one()
        assert cluster.exited() is None
        # Served both ways: some calls were fine, some refused.
        assert statuses.get("OK", 0) >= 10 and statuses.get("INVALID_ARGUMENT", 0) >= 10, statuses
        wait_for("every block of both workers free", lambda: all_idle(client))
        (done,) = client.complete(token_ids=[1, 2, 3], max_tokens=3, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 3
        assert all(w["alive"] for w in client.model_info()["workers"])
    print("statuses:", statuses)
    assert_no_errors_logged(cluster)


def assert_no_errors_logged(cluster) -> None:
    """No ERROR line and no traceback in any service's log (JSON lines, or text from libraries)."""
    for proc_log in cluster.log_dir.glob("*.log"):
        for line in proc_log.read_text(errors="replace").splitlines():
            assert "Traceback" not in line, (proc_log.name, line)
            if line.startswith("{"):
                assert json.loads(line)["level"] not in ("ERROR", "CRITICAL"), (proc_log.name, line)


def test_concurrent_arbitrary_requests_with_cancellations(cluster):
    """Batches of arbitrary requests at once, some cancelled at a random moment (while parsed, queued,
    submitted or streaming): same guarantees, and the races between cancellation and admission leak nothing."""
    statuses: dict[str, int] = {}

    async def send(stub, request: pb.GenerateRequest, cancel_after: float | None):
        call = stub.Generate(request, timeout=CALL_BOUND_S)
        if cancel_after is not None:
            asyncio.get_running_loop().call_later(cancel_after, call.cancel)
        try:
            async for _ in call:
                pass
        except asyncio.CancelledError:
            return "CANCELLED"
        except grpc.RpcError as e:
            return e.code().name
        code = await call.code()
        return code.name

    async def batch(requests, cancels):
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            return await asyncio.gather(*[send(stub, r, c) for r, c in zip(requests, cancels)])

    @settings(max_examples=6, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests=st.lists(generate_requests(), min_size=20, max_size=40), seed=st.integers(0, 2**32))
    def one(requests, seed):
        rng = random.Random(seed)
        cancels = [rng.choice([None, None, rng.uniform(0, 0.05)]) for _ in requests]
        codes = asyncio.run(asyncio.wait_for(batch(requests, cancels), 2 * CALL_BOUND_S))
        for request, cancel, code in zip(requests, cancels, codes):
            statuses[code] = statuses.get(code, 0) + 1
            allowed = {c.name for c in DOCUMENTED} | ({"ALREADY_EXISTS"} if request.request_id else set())
            if cancel is not None:
                allowed.add("CANCELLED")
            assert code in allowed, (code, request)
        assert cluster.exited() is None, "a service process died"

    one()
    print("statuses:", statuses)
    with Client(cluster.address, timeout=WAIT_S) as client:
        wait_for("every block of both workers free", lambda: all_idle(client))
        (done,) = client.complete(token_ids=[4, 5, 6], max_tokens=3, ignore_eos=True)
        assert done.finish_reason == "length"
    assert_no_errors_logged(cluster)
