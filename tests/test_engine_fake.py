"""LLMEngine and LLM over the fake worker, with Qwen3's real tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import xxhash

from offline.llm import LLM
from scheduler_svc.config import config_from_options
from scheduler_svc.engine import LLMEngine, RequestOutput
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.scheduler import QueueFullError
from scheduler_svc.tokenizer import load_tokenizer
from tests.fake_worker import QWEN_EOS_IDS, FakeWorker, fake_logprob, write_model_dir

IM_END = QWEN_EOS_IDS[0]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("fake-model"), tmp_path_factory.getbasetemp() / "qwen3-tokenizer")


@pytest.fixture(scope="session")
def qwen(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def words(qwen) -> list[int]:
    return qwen.encode(" the quick brown fox jumps over a lazy dog 日本 😀 END OF")


def word_fn(words: list[int]):
    def token(seed: int, position: int) -> int:
        return words[xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed) % len(words)]

    return token


def scripted(script: dict[int, list[int]], prompt_lens: dict[int, int]):
    """token = script[seed][position - prompt_len]."""

    def token(seed: int, position: int) -> int:
        return script[seed][position - prompt_lens[seed]]

    return token


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


def collect(got: dict[str, Collected], outputs: list[RequestOutput]) -> None:
    for out in outputs:
        c = got.setdefault(out.request_id, Collected())
        assert c.finish_reason is None, "output after the final one"
        c.token_ids += out.token_ids
        c.text += out.text
        c.finish_reason = out.finish_reason
        c.outputs.append(out)


def run(engine: LLMEngine, got: dict[str, Collected] | None = None, max_steps: int = 10_000) -> dict[str, Collected]:
    got = {} if got is None else got
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return got
        collect(got, engine.step())
    raise AssertionError("no progress")


def make_engine(model_dir, token_fn, num_blocks=256, block_size=4, **config) -> tuple[LLMEngine, FakeWorker]:
    worker = FakeWorker(num_blocks, block_size, max_model_len=512, vocab_size=151936, token_fn=token_fn)
    return LLMEngine(model_dir, worker, config_from_options(config)[0]), worker


PROMPTS = ["Hello there", "Tell me a story about a fox", [1, 2, 3, 4, 5, 6, 7, 8, 9], "日本語の文章"]


def add_all(engine: LLMEngine, max_tokens=12) -> list[str]:
    return [
        engine.add_request(p, SamplingParams(max_tokens=max_tokens + i, seed=i, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]


def test_outputs_do_not_depend_on_pipelining_chunking_or_preemption(model_dir, words, qwen):
    results = []
    for depth, num_blocks, budget in [(3, 256, 256), (2, 256, 256), (1, 256, 256), (3, 12, 8), (2, 12, 8),
                                      (1, 12, 5)]:
        engine, _ = make_engine(model_dir, word_fn(words), num_blocks=num_blocks, pipeline_depth=depth,
                                max_num_batched_tokens=budget, long_prefill_token_threshold=4)
        ids = add_all(engine)
        got = run(engine)
        results.append([(got[r].token_ids, got[r].text, got[r].finish_reason) for r in ids])
        if num_blocks == 12:
            assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.block_manager.num_free_blocks == num_blocks
    assert all(r == results[0] for r in results)
    for i, (tokens, text, reason) in enumerate(results[0]):
        assert reason == "length" and len(tokens) == 12 + i
        assert text == qwen.decode(tokens)


def test_eos_from_generation_config_stops_and_is_not_in_the_text(model_dir, qwen):
    prompt = qwen.encode("Say hi")
    fox = qwen.encode(" fox")[0]
    engine, _ = make_engine(model_dir, scripted({5: [fox, fox, IM_END, fox, fox]}, {5: len(prompt)}))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=5, seed=5))
    got = run(engine)[rid]
    assert got.token_ids == [fox, fox, IM_END] and got.text == " fox fox" and got.finish_reason == "stop"
    final = got.outputs[-1]
    assert final.finished and final.usage.completion_tokens == 3 and final.usage.prompt_tokens == len(prompt)


def test_stop_string_finishes_the_sequence_and_frees_its_blocks(model_dir, qwen):
    prompt = qwen.encode("Count")
    script = qwen.encode(" one two END OF three four five")
    engine, worker = make_engine(model_dir, scripted({3: script}, {3: len(prompt)}))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=len(script), seed=3, stop=["END OF"]))
    got = run(engine)[rid]
    assert got.text == " one two " and got.finish_reason == "stop"
    assert got.token_ids == script[:4]  # up to the token that completed the stop string
    assert engine.scheduler.block_manager.num_free_blocks == 256
    assert not engine.scheduler.has_unfinished()


def test_included_stop_strings_and_stop_tokens_stay_in_the_text(model_dir, qwen):
    """include_stop_str_in_output (vLLM's): the text runs through the stop string, or the stop token's text."""
    prompt = qwen.encode("Count")
    script = qwen.encode(" one two END OF three")
    engine, _ = make_engine(model_dir, scripted({3: script, 4: script}, {3: len(prompt), 4: len(prompt)}))
    by_string = engine.add_request(prompt, SamplingParams(max_tokens=len(script), seed=3, stop=["END OF"],
                                                          include_stop_str_in_output=True))
    by_token = engine.add_request(prompt, SamplingParams(max_tokens=len(script), seed=4, stop_token_ids=[script[2]],
                                                         include_stop_str_in_output=True))
    got = run(engine)
    assert (got[by_string].text, got[by_string].finish_reason) == (" one two END OF", "stop")
    assert (got[by_token].text, got[by_token].finish_reason) == (" one two END", "stop")


def test_stop_string_on_the_last_allowed_token_reports_stop(model_dir, qwen):
    prompt = qwen.encode("Count")
    script = qwen.encode(" one END")
    engine, _ = make_engine(model_dir, scripted({3: script}, {3: len(prompt)}))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, seed=3, stop=["END"]))
    got = run(engine)[rid]
    assert (got.text, got.finish_reason) == (" one ", "stop")


def test_held_back_text_is_flushed_at_length(model_dir, qwen):
    prompt = qwen.encode("Count")
    script = qwen.encode(" one END")
    engine, _ = make_engine(model_dir, scripted({3: script}, {3: len(prompt)}))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, seed=3, stop=["END OF"]))
    got = run(engine)[rid]
    assert (got.text, got.finish_reason) == (" one END", "length")


def test_abort_request_ends_with_an_abort_output(model_dir, words):
    engine, _ = make_engine(model_dir, word_fn(words))
    a = engine.add_request("first", SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add_request("second", SamplingParams(max_tokens=5, ignore_eos=True))
    got: dict[str, Collected] = {}
    for _ in range(3):
        collect(got, engine.step())
    assert engine.unfinished_request_ids() == [a, b]
    assert engine.abort_request(a) and not engine.abort_request(a)
    assert engine.unfinished_request_ids() == [b]
    run(engine, got)
    assert got[a].finish_reason == "abort" and got[a].outputs[-1].usage.prompt_tokens == 1
    assert got[b].finish_reason == "length" and len(got[b].token_ids) == 5
    assert engine.scheduler.block_manager.num_free_blocks == 256


def test_cached_tokens_in_usage(model_dir, words):
    engine, _ = make_engine(model_dir, word_fn(words))
    prompt = list(range(100, 130))
    first = engine.add_request(prompt, SamplingParams(max_tokens=2))
    run(engine)
    second = engine.add_request(prompt + [7], SamplingParams(max_tokens=2))
    usage = run(engine)[second].outputs[-1].usage
    assert usage.cached_prompt_tokens == 28 and usage.prompt_tokens == 31
    assert first != second


def test_logprobs_reach_the_outputs(model_dir, words):
    engine, _ = make_engine(model_dir, word_fn(words))
    rid = engine.add_request("x", SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))
    plain = engine.add_request("y", SamplingParams(max_tokens=4, ignore_eos=True))
    got = run(engine)
    for out in got[rid].outputs:
        (lp,) = out.logprobs
        assert lp.token_id == out.token_ids[0] and lp.logprob == fake_logprob(lp.token_id)
        assert len(lp.top) == 3
    assert all(o.logprobs is None for o in got[plain].outputs)


def test_seeds_are_drawn_when_not_given(model_dir, words):
    engine, worker = make_engine(model_dir, word_fn(words))
    for _ in range(3):
        engine.add_request("same", SamplingParams(max_tokens=1))
    engine.add_request("same", SamplingParams(max_tokens=1, seed=42))
    run(engine)
    seeds = [ns.sampling.seed for p in worker.plans for ns in p.new_seqs]
    assert len(set(seeds)) == 4 and seeds[-1] == 42


def test_add_request_rejects_bad_input(model_dir, words):
    engine, _ = make_engine(model_dir, word_fn(words), max_waiting=1)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("x", SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("x", SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 999_999])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("")
    engine.add_request("x", request_id="r")
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("y", request_id="r")
    with pytest.raises(QueueFullError):
        engine.add_request("y")


def test_engine_takes_limits_from_the_worker(model_dir, words):
    engine, worker = make_engine(model_dir, word_fn(words), num_blocks=33, block_size=8, max_model_len=100)
    bm = engine.scheduler.block_manager
    assert (bm.num_blocks, bm.block_size, engine.scheduler.max_model_len) == (33, 8, 100)
    assert engine.scheduler.epoch == worker.epoch
    assert worker.batch.max_num_batched_tokens == engine.config.limits.max_num_batched_tokens


def test_llm_generate(model_dir, words, qwen):
    worker = FakeWorker(64, 4, max_model_len=256, vocab_size=151936, token_fn=word_fn(words))
    with LLM(model_dir, executor=worker, max_num_seqs=3, max_waiting=2) as llm:
        params = [SamplingParams(max_tokens=3 + i, ignore_eos=True, seed=i) for i in range(7)]
        outs = llm.generate([f"prompt {i}" for i in range(7)], params, use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [3 + i for i in range(7)]
        for o in outs:
            assert o.text == qwen.decode(o.token_ids) and o.finish_reason == "length"
        (single,) = llm.generate("one more", SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(single.token_ids) == 2
    assert worker.closed
    with pytest.raises(TypeError, match="unknown options"):
        LLM(model_dir, executor=worker, dtype="float32")


def test_llm_generate_takes_vllms_priority(model_dir, words):
    """LLM.generate's priority is vLLM's: one per prompt, the lowest served first."""
    worker = FakeWorker(64, 4, max_model_len=256, vocab_size=151936, token_fn=word_fn(words))
    with LLM(model_dir, executor=worker, max_num_seqs=1) as llm:
        params = SamplingParams(max_tokens=2, ignore_eos=True, seed=0)
        outs = llm.generate(["a", "b", "c"], params, use_tqdm=False, priority=[0, 0, -5])
        assert [len(o.token_ids) for o in outs] == [2, 2, 2]
        with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
            llm.generate(["a", "b", "c"], params, use_tqdm=False, priority=[0, 1])
    admitted = [ns.seq_id for plan in worker.plans for ns in plan.new_seqs]
    first = min(admitted)
    assert admitted == [first + 2, first, first + 1]


def test_pipeline_depth_below_one_is_refused(model_dir, words):
    from scheduler_svc import cli

    with pytest.raises(ValueError, match="pipeline_depth"):
        make_engine(model_dir, word_fn(words), pipeline_depth=0)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", str(model_dir), "--plaintext", "--pipeline-depth", "0"])
    assert exit_info.value.code == 2


def test_vllms_scheduler_flags_reach_the_config(model_dir):
    """vLLM's --enable-prefix-caching / --no-enable-prefix-caching and --long-prefill-token-threshold."""
    from scheduler_svc import cli

    base = ["--model", str(model_dir), "--plaintext"]
    config = cli._parse(cli.build_parser(), base).config
    assert config.enable_prefix_caching and config.long_prefill_token_threshold == 0
    config = cli._parse(cli.build_parser(), [*base, "--no-enable-prefix-caching",
                                             "--long-prefill-token-threshold", "64"]).config
    assert not config.enable_prefix_caching and config.chunk_cap(16) == 64
    assert cli._parse(cli.build_parser(), [*base, "--enable-prefix-caching"]).config.enable_prefix_caching
    with pytest.raises(SystemExit) as exit_info:
        cli._parse(cli.build_parser(), [*base, "--long-prefill-token-threshold", "-1"])
    assert exit_info.value.code == 2


def test_the_scheduler_refuses_a_generation_config_it_cannot_sample_with(model_dir, capsys):
    """--generation-config FOLDER without the file, --override-generation-config not a JSON object, not a sampling
    field or out of range: a usage error naming the flag, before anything starts."""
    from scheduler_svc import cli

    for flags, message in ((["--generation-config", str(model_dir / "none")], "no generation_config.json there"),
                           (["--override-generation-config", "[1]"], "must be a JSON object"),
                           (["--override-generation-config", '{"do_sample": true}'], "do_sample are not among"),
                           (["--override-generation-config", '{"temperature": -1}'], "temperature")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--model", str(model_dir), "--plaintext", *flags])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
