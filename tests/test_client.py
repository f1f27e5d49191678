"""Client library and `splitserve` CLI against a fake in-process Generation server (no scheduler, no torch)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from concurrent import futures
from contextlib import aclosing

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client import AsyncClient, Client, Completion, Usage
from client.cli import main
from client.client import GENERATION_SERVICE, build_request
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0


class FakeGeneration(pb_grpc.GenerationServicer):
    """Echoes the prompt back one token per delta (token t has text chr(t)), n completions interleaved.

    Prompt text "abort" fails with INVALID_ARGUMENT; "hang" sends one delta, then holds the call open until
    the client cancels it (recorded in `cancelled`, keyed by request id) or 10 s pass.
    """

    def __init__(self) -> None:
        self.requests: dict[str, pb.GenerateRequest] = {}
        self.metadata: dict[str, tuple[tuple[str, str], ...]] = {}
        self.cancelled: dict[str, threading.Event] = {}

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        self.requests[request.request_id] = request
        self.metadata[request.request_id] = tuple((m.key, m.value) for m in context.invocation_metadata())
        if request.text == "abort":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text: the fake refuses 'abort'")
        if request.text == "hang":
            yield from self._hang(request, context)
            return
        prompt = self._prompt_ids(request)
        limit = request.stopping.max_tokens if request.stopping.HasField("max_tokens") else len(prompt)
        out = prompt[:limit]
        n = request.n if request.HasField("n") else 1
        for pos, token in enumerate(out):
            for index in range(n):  # interleaved, as a real server streams them
                response = pb.GenerateResponse(request_id=request.request_id, index=index, token_ids=[token],
                                               text=chr(token))
                if request.HasField("logprobs"):
                    response.logprobs.add(logprob=-float(pos), top=[pb.TopLogprob(token_id=token, logprob=-0.5)]
                                          * request.logprobs)
                yield response
        finish = pb.FINISH_REASON_LENGTH if len(out) < len(prompt) else pb.FINISH_REASON_STOP
        for index in range(n):
            yield pb.GenerateResponse(
                request_id=request.request_id, index=index, finish_reason=finish,
                stop_reason="" if finish == pb.FINISH_REASON_LENGTH else "eos",
                usage=pb.Usage(prompt_tokens=len(prompt), completion_tokens=len(out), cached_prompt_tokens=1))

    @staticmethod
    def _prompt_ids(request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        text = request.chat.messages[-1].content if kind == "chat" else request.text
        return [ord(c) for c in text]

    def _hang(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        cancelled = self.cancelled.setdefault(request.request_id, threading.Event())
        ended_here = threading.Event()
        # The server may drop this generator at its yield once the call is cancelled, so observe the end of
        # the call, not the loop below.
        context.add_callback(lambda: ended_here.is_set() or cancelled.set())
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[104], text="h")
        deadline = time.monotonic() + 2 * WAIT_S
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.01)
        if context.is_active():
            ended_here.set()

    def was_cancelled(self, request_id: str) -> bool:
        return self.cancelled.setdefault(request_id, threading.Event()).wait(WAIT_S)

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(model="fake", max_model_len=512, vocab_size=256, eos_token_ids=[0], num_workers=1)

    def Embed(self, request, context):
        """Each text's vector: its first two characters' codes (a cosine a test can work out)."""
        return pb.EmbedResponse(pooling="last", embeddings=[
            pb.Embedding(values=[ord(c) for c in i.text[:2]], prompt_tokens=len(i.text)) for i in request.inputs])

    def Classify(self, request, context):
        """Each text's logits: its first two characters' codes over 100, as labels "a" and "b" (softmax)."""
        logits = [[ord(c) / 100 for c in i.text[:2]] for i in request.inputs]
        return pb.ClassifyResponse(labels=["a", "b"], classifications=[
            pb.Classification(logits=v, probs=softmax(v), prompt_tokens=len(i.text))
            for v, i in zip(logits, request.inputs)])

    def Tokenize(self, request, context):
        text = request.chat.messages[-1].content if request.WhichOneof("prompt") == "chat" else request.text
        return pb.TokenizeResponse(token_ids=[ord(c) for c in text])

    def ResetPrefixCache(self, request, context):
        return pb.ResetPrefixCacheResponse(dropped_blocks=7)

    def UpdateWeights(self, request, context):
        self.update = request
        if not request.model_path.startswith("/"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_path: the fake reads absolute folders only")
        return pb.UpdateWeightsResponse(model_path=request.model_path, num_workers=3)


def softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


@pytest.fixture(scope="module")
def fake() -> FakeGeneration:
    return FakeGeneration()


@pytest.fixture(scope="module")
def address(fake: FakeGeneration):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(fake, server)
    health_servicer = health.HealthServicer()
    health_servicer.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def client(address: str):
    with Client(address, timeout=WAIT_S) as c:
        yield c


# --- request building ---------------------------------------------------------------------------------


def test_only_the_given_fields_are_sent(client: Client, fake: FakeGeneration):
    client.complete("hi", request_id="bare")
    bare = fake.requests["bare"]
    assert bare.text == "hi"
    assert not bare.HasField("sampling") and not bare.HasField("stopping")
    assert not bare.HasField("n") and not bare.HasField("logprobs") and not bare.HasField("skip_special_tokens")

    client.complete("hi", request_id="some", temperature=0.0, top_k=0, seed=0, max_tokens=1, stop="x",
                    logprobs=0, skip_special_tokens=False, priority=3)
    some = fake.requests["some"]
    assert some.sampling.HasField("temperature") and some.sampling.temperature == 0.0
    assert some.sampling.HasField("top_k") and some.sampling.HasField("seed")
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert not some.sampling.HasField(name), name
    assert some.stopping.HasField("max_tokens") and not some.stopping.HasField("min_tokens")
    assert list(some.stopping.stop) == ["x"] and not some.stopping.ignore_eos
    assert some.HasField("logprobs") and some.logprobs == 0
    assert some.HasField("skip_special_tokens") and not some.skip_special_tokens
    assert some.priority == 3 and not some.HasField("n")


def test_prompt_kinds_and_chat_switch():
    assert build_request(token_ids=[1, 2]).token_ids.ids == [1, 2]
    chat = build_request(messages=[{"role": "user", "content": "x"}]).chat
    assert chat.messages[0].role == "user" and not chat.HasField("enable_thinking")
    chat = build_request(messages=[{"role": "user", "content": "x"}], enable_thinking=False).chat
    assert chat.HasField("enable_thinking") and not chat.enable_thinking
    request = build_request("x", stop=["a", "b"], stop_token_ids=[7], ignore_eos=True)
    assert list(request.stopping.stop) == ["a", "b"] and list(request.stopping.stop_token_ids) == [7]
    assert request.stopping.ignore_eos


def test_chat_content_as_openais_list_of_parts():
    """OpenAI's content parts: their texts joined by newlines, as the gateway joins them (vLLM's way); a part that is
    not text is refused before any call, naming it."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = build_request(messages=[{"role": "user", "content": parts}, {"role": "assistant", "content": None}]).chat
    assert [m.content for m in chat.messages] == ["a\nb", ""]
    with pytest.raises(ValueError, match=r"content\[1\]: only text parts are supported, got type 'image_url'"):
        build_request(messages=[{"role": "user", "content": [parts[0], {"type": "image_url", "image_url": {}}]}])


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "a", "token_ids": [1]}, {"prompt": "a", "messages": []},
                                    {"prompt": "a", "enable_thinking": True}])
def test_bad_prompt_arguments_fail_before_any_call(client: Client, kwargs):
    with pytest.raises(ValueError):
        client.generate(**kwargs)


def test_timeout_and_metadata_reach_the_server(address: str, fake: FakeGeneration):
    with Client(address, timeout=WAIT_S, metadata=[("x-tenant", "t1")]) as c:
        c.complete("hi", request_id="meta")
        assert ("x-tenant", "t1") in fake.metadata["meta"]
        with pytest.raises(grpc.RpcError) as error:
            c.complete("hang", request_id="deadline", timeout=0.2)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


# --- streaming ----------------------------------------------------------------------------------------


def test_stream_of_deltas_ends_with_finish_and_usage(client: Client):
    deltas = list(client.generate("abc", max_tokens=2, logprobs=1))
    assert [d.text for d in deltas] == ["a", "b", ""]
    assert [d.token_ids for d in deltas] == [[97], [98], []]
    assert deltas[0].logprobs == [(0.0, [(97, -0.5)])] and deltas[-1].logprobs is None
    assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "length" and deltas[-1].stop_reason is None
    assert deltas[-1].usage == Usage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1)


def test_n_completions_are_told_apart(client: Client):
    deltas = list(client.generate(token_ids=[72, 105], n=3))
    assert sorted({d.index for d in deltas}) == [0, 1, 2]
    completions = client.complete(token_ids=[72, 105], n=3, logprobs=0)
    assert [c.index for c in completions] == [0, 1, 2]
    for c in completions:
        assert c == Completion(index=c.index, text="Hi", token_ids=[72, 105], finish_reason="stop",
                               stop_reason="eos", usage=Usage(2, 2, 1), logprobs=[(0.0, []), (-1.0, [])])


def test_chat_prompt(client: Client):
    [completion] = client.complete(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "yo"}],
                                   enable_thinking=False)
    assert completion.text == "yo" and completion.logprobs is None


def test_breaking_out_cancels_the_call(client: Client, fake: FakeGeneration):
    for delta in client.generate("hang", request_id="sync-break"):
        assert delta.text == "h"
        break
    assert fake.was_cancelled("sync-break")


def test_error_status_and_details_reach_the_caller(client: Client):
    with pytest.raises(grpc.RpcError) as error:
        client.complete("abort")
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refuses" in error.value.details()


def test_unary_calls_and_health(client: Client, address: str):
    assert client.model_info()["model"] == "fake"
    assert client.model_info()["eos_token_ids"] == [0]
    assert client.tokenize("Hi") == [72, 105]
    assert client.tokenize(messages=[{"role": "user", "content": "A"}]) == [65]
    assert client.health(GENERATION_SERVICE) == "SERVING"
    client.wait_until_ready(WAIT_S)
    with Client("127.0.0.1:1") as nowhere, pytest.raises(TimeoutError):
        nowhere.wait_until_ready(0.3)


# --- asyncio ------------------------------------------------------------------------------------------


def test_async_client(address: str, fake: FakeGeneration):
    async def scenario() -> None:
        async with AsyncClient(address, timeout=WAIT_S) as c:
            await c.wait_until_ready(WAIT_S)
            assert [d.text async for d in c.generate("ok")] == ["o", "k", ""]
            completions = await c.complete("ab", n=2)
            assert [(x.index, x.text, x.finish_reason) for x in completions] == [(0, "ab", "stop"), (1, "ab", "stop")]
            assert await c.tokenize("A") == [65]
            assert (await c.model_info())["max_model_len"] == 512
            assert await c.health(GENERATION_SERVICE) == "SERVING"
            with pytest.raises(grpc.RpcError) as error:
                await c.complete("abort")
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            first = asyncio.Event()

            async def consume() -> None:
                async for _ in c.generate("hang", request_id="async-cancel"):
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), WAIT_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(fake.was_cancelled, "async-cancel")

            async with aclosing(c.generate("hang", request_id="async-break")) as stream:
                async for _ in stream:
                    break
            assert await asyncio.to_thread(fake.was_cancelled, "async-break")

    asyncio.run(asyncio.wait_for(scenario(), 30))


# --- command line -------------------------------------------------------------------------------------


def test_cli_streams_text(address: str, capsys):
    assert main(["generate", "--address", address, "--max-tokens", "5", "Hello, world"]) == 0
    assert capsys.readouterr().out == "Hello\n"
    assert main(["generate", "--address", address, "--token-ids", "72,105", "--n", "2"]) == 0
    assert capsys.readouterr().out == "--- completion 0 ---\nHi\n--- completion 1 ---\nHi\n"


def test_cli_json_lines(address: str, fake: FakeGeneration, capsys):
    argv = ["generate", "--address", address, "--json", "--chat", "--no-thinking", "--temperature", "0",
            "--stop", "x", "--stop", "y", "--ignore-eos", "--seed", "7", "--bad-word", "no", "Hi"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["type"] for line in lines] == ["delta", "delta", "delta", "completion"]
    assert [line["text"] for line in lines[:3]] == ["H", "i", ""]
    assert lines[-1] == {"type": "completion", "index": 0, "text": "Hi", "token_ids": [72, 105],
                         "finish_reason": "stop", "stop_reason": "eos", "logprobs": None,
                         "usage": {"prompt_tokens": 2, "completion_tokens": 2, "cached_prompt_tokens": 1},
                         "prompt_logprobs": None, "prompt_token_ids": None, "cumulative_logprob": None,
                         "weight_version": None}
    request = next(r for r in reversed(fake.requests.values()) if r.WhichOneof("prompt") == "chat")
    assert request.chat.messages[0].role == "user" and request.chat.HasField("enable_thinking")
    assert request.sampling.HasField("temperature") and request.sampling.seed == 7
    assert list(request.stopping.stop) == ["x", "y"] and request.stopping.ignore_eos
    assert list(request.sampling.bad_words) == ["no"]
    assert not request.sampling.HasField("top_p")


def test_cli_errors_exit_2_without_traceback(address: str, capsys):
    assert main(["generate", "--address", address, "abort"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: text: the fake refuses") and "Traceback" not in err
    assert main(["generate", "--address", address]) == 2
    assert capsys.readouterr().err == "error: give exactly one of PROMPT or --token-ids\n"
    assert main(["info", "--address", "127.0.0.1:1", "--timeout", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: ")
    assert main(["generate", "--address", address, "--max-tokens", "0", "Hi"]) == 2
    assert "--max-tokens 0 needs --prompt-logprobs" in capsys.readouterr().err
    assert main(["health", "--address", address, "--service", "foo"]) == 2
    err = capsys.readouterr().err
    assert "no health service 'foo'" in err and "Traceback" not in err


def test_cli_info_tokenize_health_embed_score(address: str, fake: FakeGeneration, capsys):
    assert main(["info", "--address", address]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 256
    assert main(["reset-prefix-cache", "--address", address]) == 0
    assert capsys.readouterr().out == "7\n"
    assert main(["update-weights", "--address", address, "/ckpt/step-2"]) == 0
    assert capsys.readouterr().out == "3\n" and not fake.update.abort_requests
    assert main(["update-weights", "--address", address, "/ckpt/step-3", "--abort-requests"]) == 0
    assert capsys.readouterr().out == "3\n" and fake.update.abort_requests
    assert main(["update-weights", "--address", address, "ckpt"]) == 2
    assert capsys.readouterr().err.startswith("error: INVALID_ARGUMENT: model_path")
    assert main(["tokenize", "--address", address, "Hi"]) == 0
    assert capsys.readouterr().out == "72,105\n"
    assert main(["health", "--address", address]) == 0
    assert capsys.readouterr().out == "SERVING\n"
    assert main(["embed", "--address", address, "AB", "CD"]) == 0
    assert capsys.readouterr().out == "[65.0, 66.0]\n[67.0, 68.0]\n"
    assert main(["score", "--address", address, "AA", "BB", "A\x00"]) == 0  # (65, 65) against (66, 66), (65, 0)
    assert capsys.readouterr().out == "1.000000\n0.707107\n"
    assert main(["classify", "--address", address, "AA", "Ad"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out[0] == {"a": 0.5, "b": 0.5} and out[1]["b"] == pytest.approx(1 / (1 + math.exp(-0.35)))
