"""When a call's coroutine wakes (scheduler_svc/frontend.py's _Stream): every output with stream_interval 1;
otherwise only when a message may go out, and always on a completion's first token (the other n - 1
completions of a request start on it)."""
from __future__ import annotations

from scheduler_svc.output import RequestOutput
from scheduler_svc.frontend import FAILED, _Stream


def _wakes(stream: _Stream, out) -> bool:
    stream.ready.clear()
    stream.put(out)
    return stream.ready.is_set()


def token(rid: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [7], "x", finished=finished, finish_reason="length" if finished else None)


def test_interval_1_wakes_on_every_output():
    stream = _Stream(interval=1)
    assert all(_wakes(stream, token("a")) for _ in range(5))


def test_interval_0_wakes_on_first_tokens_ends_and_failures_only():
    stream = _Stream(interval=0)
    assert _wakes(stream, token("a#0")) and _wakes(stream, token("a#1"))  # each completion's first token
    assert not any(_wakes(stream, token(rid)) for rid in ("a#0", "a#1", "a#0"))
    assert _wakes(stream, token("a#1", finished=True))
    assert not _wakes(stream, token("a#0"))
    assert _wakes(stream, FAILED)
    assert len(stream.outputs) == 8  # nothing is dropped, only the wake-ups are


def test_interval_k_wakes_when_a_completion_holds_k_tokens():
    stream = _Stream(interval=3)
    woke = [_wakes(stream, token("a")) for _ in range(8)]
    # the first token wakes (and is held: 1); the 3rd and the 6th bring what is held to 3
    assert woke == [True, False, True, False, False, True, False, False]
