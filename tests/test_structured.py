"""Structured outputs through real processes (client -> scheduler -> worker, CPU): a random-weight model writes
what only the constraint can make valid (regex, choice, JSON schema, Lark grammar), at temperature > 0 over
many seeds, pipelined beside free requests that keep exactly their tokens; bad constraints are refused naming
their field; a grammar that no token can continue ends its request with finish reason "grammar". The worker's
side alone (masks fed through preemption) is tested on a ModelRunner at the end."""
from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest

from client import AsyncClient, Client
from client.launcher import LocalCluster
from tests import sim_cluster

pytestmark = pytest.mark.timeout(300)

WORKER_ARGS = ["--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "32", "--max-num-batched-tokens", "512"]
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "inner": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5}},
                  "required": ["level"], "additionalProperties": False},
    },
    "required": ["colour", "count", "ok", "tags", "inner"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    c = LocalCluster(tiny_model_dir, num_workers=1, worker_args=WORKER_ARGS, scheduler_args=sim_cluster.TREE_ARGS,
                     log_dir=tmp_path_factory.mktemp("structured-logs")).start(timeout=240)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.address, timeout=120) as c:
        yield c


def _gather(address: str, requests: list[dict]) -> list:
    async def main():
        async with AsyncClient(address, timeout=120) as c:
            return [cs[0] for cs in await asyncio.gather(*(c.complete(**r) for r in requests))]
    return asyncio.run(main())


def test_regex_choice_schema_and_grammar_hold_at_temperature_for_every_seed(cluster):
    lark = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,6}/'
    requests = []
    for seed in range(12):
        base = dict(prompt=f"Request {seed}:", temperature=0.9, seed=seed, max_tokens=80)
        requests += [dict(base, structured={"regex": EMAIL}), dict(base, structured={"choice": ["yes", "no", "maybe"]}),
                     dict(base, structured={"json_schema": SCHEMA}), dict(base, structured={"grammar": lark})]
    outs = _gather(cluster.address, requests)
    for r, out in zip(requests, outs):
        kind, spec = next(iter(r["structured"].items()))
        assert out.finish_reason == "stop", (r, out.text)
        if kind == "regex":
            assert re.fullmatch(EMAIL, out.text), out.text
        elif kind == "choice":
            assert out.text in spec
        elif kind == "json_schema":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        else:
            assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,6}!", out.text), out.text


def test_json_object_is_an_object(client):
    for seed in range(4):
        out, = client.complete("JSON:", structured={"json_object": True}, temperature=0.7, seed=seed, max_tokens=400)
        if out.finish_reason == "stop":  # a random model may fill the object beyond max_tokens
            assert isinstance(json.loads(out.text), dict), out.text
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")


def test_free_requests_beside_constrained_ones_keep_their_greedy_tokens(cluster, client):
    free = [dict(prompt=f"Story number {i} begins", temperature=0.0, max_tokens=24, ignore_eos=True) for i in range(6)]
    alone = [client.complete(**r)[0].token_ids for r in free]
    constrained = [dict(prompt=f"Mail {i}:", temperature=0.8, seed=i, max_tokens=40, structured={"regex": EMAIL})
                   for i in range(10)]
    mixed = _gather(cluster.address, [x for pair in zip(free + free[:4], constrained) for x in pair])
    assert [o.token_ids for o in mixed[0::2][:6]] == alone
    assert all(re.fullmatch(EMAIL, o.text) for o in mixed[1::2])


@pytest.mark.parametrize("structured,field", [
    ({"regex": "a(b"}, "structured.regex"),
    ({"json_schema": "{not json"}, "structured.json_schema"),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 2}}, "structured.json_schema"),
    ({"grammar": "start: undefined_rule"}, "structured.grammar"),
    ({"choice": []}, "structured.choice.choices"),
    ({"json_object": False}, "structured.json_object"),
    ({"structural_tag": "{not json"}, "structured.structural_tag"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "end": ""}]}}, "structured.structural_tag.triggers"),
    ({"structural_tag": {"structures": [], "triggers": ["<a"]}}, "structured.structural_tag.structures"),
    ({"structural_tag": {"structures": [{"begin": "<b>", "end": ""}], "triggers": ["<a"]}},
     "structured.structural_tag.structures[0].begin"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "schema": [], "end": ""}], "triggers": ["<a"]}},
     "structured.structural_tag.structures[0].schema"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "schema": {"type": "nope"}, "end": ""}], "triggers": ["<a"]}},
     "structured.structural_tag"),
    ({"structural_tag": {"structures": [{"begin": "<|im_end|>", "end": ""}], "triggers": ["<|im_end|>", "<x>"]}},
     "structured.structural_tag.triggers"),
])
def test_a_constraint_that_does_not_compile_is_invalid_argument_naming_its_field(client, structured, field):
    with pytest.raises(grpc.RpcError) as e:
        client.complete("x", structured=structured, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()


@pytest.mark.parametrize("extra,field", [({"ignore_eos": True}, "stopping.ignore_eos"),
                                          ({"min_tokens": 2}, "stopping.min_tokens")])
def test_structured_output_refuses_what_would_run_past_its_grammar(client, extra, field):
    with pytest.raises(grpc.RpcError) as e:
        client.complete("x", structured={"regex": "a+"}, max_tokens=4, **extra)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)


def test_max_tokens_cuts_a_constrained_output_with_length(client):
    out, = client.complete("x", structured={"regex": "[a-z]{50,60}"}, max_tokens=5, temperature=0.5, seed=1)
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and re.fullmatch("[a-z]+", out.text)


def test_the_same_schema_compiles_once():
    from scheduler_svc import structured

    structured.compile_grammar.cache_clear()
    spec = json.dumps(SCHEMA)
    for _ in range(3):
        structured.compile_grammar("json_schema", spec)
    info = structured.compile_grammar.cache_info()
    assert info.misses == 1 and info.hits == 2


# ---- the worker alone ------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel_rows", [1, 16], ids=["on-the-pool", "on-the-calling-thread"])
def test_worker_masks_survive_preemption_and_a_dead_grammar_forces_eos(tiny_model_dir, monkeypatch, parallel_rows):
    """Rows resent after a drop (their generated tokens fed to a fresh matcher) still follow the grammar; a
    matcher put into an error state makes its row sample an EOS and the step report it. Masks filled and
    tokens fed on llguidance's thread pool or on the calling thread alike."""
    import llguidance

    monkeypatch.setattr("worker_svc.runtime.grammar.PARALLEL_ROWS", parallel_rows)

    from protos import worker_pb2 as pb
    from common.model_files import eos_token_ids
    from scheduler_svc.structured import compile_grammar
    from tests.paged_driver import PagedDriver, run_with_drops
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(tiny_model_dir, RunnerConfig(num_blocks=128, block_size=16))
    grammar = compile_grammar("regex", "[a-z]{20,30}")
    params = [pb.SamplingParams(temperature=0.8, top_p=1.0, repetition_penalty=1.0, logprobs=-1, seed=s,
                                grammar=grammar) for s in range(6)]
    driver = PagedDriver(runner, chunk=8)
    seqs = [driver.add([1 + s, 2, 3, 4, 5], 16, p) for s, p in enumerate(params)]
    run_with_drops(driver, seqs, drop_at=(3, 7))
    eos = set(eos_token_ids(tiny_model_dir))
    tok = llguidance.LLTokenizer((tiny_model_dir / "tokenizer.json").read_text(), n_vocab=runner.model_config.vocab_size)
    for s in seqs:  # the driver runs past EOS: once the grammar is complete, only EOS may follow
        text_ids = [t for t in s.generated if t not in eos]
        assert s.generated[:len(text_ids)] == text_ids, s.generated
        assert re.fullmatch("[a-z]+", tok.decode_str(text_ids)), s.generated

    dead = driver.add([9, 9, 9], 8, params[0])
    driver.run_step(only={dead.seq_id})  # its prompt and first token
    runner.grammars._matchers[runner.batch.seqs[dead.seq_id].row].consume_token(0)  # "!" is no [a-z]
    out = driver.run_step(only={dead.seq_id})
    assert list(driver.last_result.grammar_dead_ids) == [dead.seq_id]
    assert out[dead.seq_id] in eos


def test_worker_decode_steps_mixing_free_and_constrained_rows(tiny_model_dir):
    """A decode step samples again only its rows that need more than a temperature: here the constrained ones,
    interleaved with free rows. The free rows keep the tokens they sample alone; the constrained ones follow their
    grammar through drops (their matchers fed from the right rows of the step); a dead grammar is reported for
    its own sequence."""
    import llguidance

    from common.model_files import eos_token_ids
    from protos import worker_pb2 as pb
    from scheduler_svc.structured import compile_grammar
    from tests.paged_driver import PagedDriver, run_with_drops
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    grammar = compile_grammar("regex", "[a-z]{20,30}")

    def params(seed: int, constrained: bool) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=0.8, top_p=1.0, repetition_penalty=1.0, logprobs=-1, seed=seed,
                                 grammar=grammar if constrained else "")

    def driver() -> PagedDriver:
        return PagedDriver(ModelRunner(tiny_model_dir, RunnerConfig(num_blocks=128, block_size=16)), chunk=8)

    free = [([7, s, 3], params(100 + s, False)) for s in range(3)]
    alone = []
    for prompt, p in free:
        d = driver()
        s = d.add(prompt, 16, p)
        d.run_all()
        alone.append(s.generated)
    d = driver()
    seqs = []
    for k in range(3):  # free rows first in each pair, so a constrained row's place in the step is not its own
        seqs.append(d.add(*free[k][:1], 16, free[k][1]))
        seqs.append(d.add([1 + k, 2, 3, 4, 5], 16, params(k, True)))
    run_with_drops(d, seqs, drop_at=(3, 7))
    assert [s.generated for s in seqs[0::2]] == alone
    eos = set(eos_token_ids(tiny_model_dir))
    runner = d.runner
    tok = llguidance.LLTokenizer((tiny_model_dir / "tokenizer.json").read_text(), n_vocab=runner.model_config.vocab_size)
    for s in seqs[1::2]:
        text_ids = [t for t in s.generated if t not in eos]
        assert re.fullmatch("[a-z]+", tok.decode_str(text_ids)), s.generated

    other = d.add([8, 8, 8], 8, params(7, False))
    dead = d.add([9, 9, 9], 8, params(0, True))
    d.run_step(only={other.seq_id, dead.seq_id})  # prompts and first tokens
    runner.grammars._matchers[runner.batch.seqs[dead.seq_id].row].consume_token(0)  # "!" is no [a-z]
    out = d.run_step(only={other.seq_id, dead.seq_id})
    assert list(d.last_result.grammar_dead_ids) == [dead.seq_id]
    assert out[dead.seq_id] in eos


def _thinking_matcher(tiny_model_dir, structured: dict):
    """A worker's matcher of `structured` (with its reasoning) over the tiny model's vocabulary, and the tokenizer."""
    import llguidance
    from tokenizers import Tokenizer

    from client.client import structured_output
    from scheduler_svc.structured import grammar_of
    from worker_svc.runtime.grammar import _Vocabulary

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    vocab = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tiny_model_dir, tok.get_vocab_size())))
    grammar = grammar_of(structured_output(structured))
    return (lambda: llguidance.LLMatcher(vocab, grammar, log_level=0)), tok


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
def test_a_reasoning_models_thinking_stays_free_and_the_constraint_follows_it(tiny_model_dir, reasoning):
    """StructuredOutput.reasoning: any text up to the first </think> (after a <think> the answer opens, for qwen3; from
    the start, for deepseek_r1), the whitespace after it, then the constraint; nothing else after the thinking."""
    new, tok = _thinking_matcher(tiny_model_dir, {"json_schema": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}, "reasoning": reasoning})

    def reads(text: str) -> tuple[bool, bool]:
        m = new()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids), m.is_accepting()

    opened = "<think>" if reasoning == "qwen3" else ""
    thought = f"{opened}\nThe user wants {{a number}}; </thin or <think> are text here.\n</think>"
    assert reads(thought + '\n\n{"n":7}') == (True, True)
    assert reads(thought + '{"n":7}') == (True, True)
    assert reads(thought + "\n\nSeven.")[0] is False  # after the thinking, only the constraint
    assert reads(thought + '\n\n{"n":7}</think>')[0] is False
    assert reads('{"n":7}') == ((True, True) if reasoning == "qwen3" else (True, False))  # r1 must close its thinking


CALL = {"type": "object", "required": ["n", "ok"], "additionalProperties": False,
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
CALL_TAG = {"structures": [{"begin": '<tool_call>{"name": "f", "arguments": ', "schema": CALL, "end": "}</tool_call>"}],
            "triggers": ["<tool_call>"]}


def test_a_structural_tags_text_is_free_until_a_trigger_and_its_structure_holds_after(tiny_model_dir):
    """vLLM's structural tag: any text, in which the trigger (Qwen's <tool_call>, a token of its vocabulary that is
    not special) opens the structure: the rest of its begin, compact JSON under its schema, its end; text again."""
    new, tok = _thinking_matcher(tiny_model_dir, {"structural_tag": CALL_TAG})

    def reads(text: str) -> tuple[bool, bool]:
        m = new()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids), m.is_accepting()

    call = '<tool_call>{"name": "f", "arguments": {"n":7,"ok":true}}</tool_call>'
    assert reads("Let me {check} that.") == (True, True)
    assert reads(f"Let me check.{call} And {call}, then done.") == (True, True)
    assert reads(call[:-len("}</tool_call>")]) == (True, False)  # its end is due
    assert reads('<tool_call>{"name": "g"')[0] is False
    assert reads('<tool_call>{"name": "f", "arguments": {"n":700,"ok":true}')[0] is False
    assert reads('<tool_call>{"name": "f", "arguments": {"n": 7')[0] is False  # compact, as json_schema's


def test_a_structural_tag_through_the_services(client, tiny_model_dir):
    """A bias on <tool_call> makes a random model open the structure now and then, free text between: every one it
    completes is the structure, its JSON valid under the schema."""
    from tokenizers import Tokenizer

    trigger = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).token_to_id("<tool_call>")
    for seed in range(3):
        out, = client.complete("Call f:", structured={"structural_tag": CALL_TAG}, temperature=0.8, seed=seed,
                               max_tokens=120, logit_bias={trigger: 30.0})
        calls = re.findall(r'<tool_call>\{"name": "f", "arguments": (.*?)\}</tool_call>', out.text)
        assert len(calls) >= 2 and out.text.count("<tool_call>") - len(calls) <= 1, out.text  # the last one cut
        for arguments in calls:
            jsonschema.validate(json.loads(arguments), CALL)


def test_an_unknown_reasoning_is_invalid_argument_naming_it(client):
    with pytest.raises(grpc.RpcError) as e:
        client.complete("x", structured={"regex": "a+", "reasoning": "o1"}, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("structured.reasoning"), e.value.details()


def test_a_constrained_answer_after_thinking_through_the_services(client, tiny_model_dir):
    """deepseek_r1's thinking, cut short by a bias on </think>, then JSON valid under the schema."""
    from tokenizers import Tokenizer

    end = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).token_to_id("</think>")
    for seed in range(3):
        out, = client.complete("Think, then answer:", structured={"json_schema": SCHEMA, "reasoning": "deepseek_r1"},
                               temperature=0.8, seed=seed, max_tokens=200, logit_bias={end: 30.0})
        thinking, _, answer = out.text.partition("</think>")
        assert out.finish_reason == "stop" and "</think>" in out.text, out.text
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_harmonys_analysis_stays_free_and_the_final_message_is_constrained(harmony_model_dir):
    """openai_gptoss: an optional analysis message, free, then the final message's text under the constraint; the
    markers are special tokens of the model's tokenizer (tests/conftest.py's harmony_model_dir)."""
    new, tok = _thinking_matcher(harmony_model_dir, {"json_schema": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}, "reasoning": "openai_gptoss"})

    def reads(text: str) -> tuple[bool, bool]:
        m = new()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids), m.is_accepting()

    analysis = "<|channel|>analysis<|message|>They want {n}: final and <think> are text here.<|end|><|start|>assistant"
    assert reads(analysis + '<|channel|>final<|message|>{"n":3}') == (True, True)
    assert reads('<|channel|>final<|message|>{"n":3}') == (True, True)
    assert reads(analysis + "<|channel|>final<|message|>Three.")[0] is False
    assert reads(analysis + '<|channel|>commentary<|message|>{"n":3}')[0] is False
    assert reads('{"n":3}')[0] is False


def test_harmony_needs_its_special_tokens_in_the_tokenizer(client):
    with pytest.raises(grpc.RpcError) as e:
        client.complete("x", structured={"json_object": True, "reasoning": "openai_gptoss"}, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = e.value.details()
    assert details.startswith("structured.reasoning openai_gptoss needs the special tokens"), details
