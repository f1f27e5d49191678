"""When a call's coroutine wakes (scheduler_svc/frontend.py's _Stream): every output with stream_interval 1;
otherwise only when a message may go out, and always on a completion's first token (the other n - 1
completions of a request start on it)."""
from __future__ import annotations

from types import SimpleNamespace

from scheduler_svc.frontend import _Stream


def completion() -> SimpleNamespace:
    """What _Stream reads and writes of a Completion."""
    return SimpleNamespace(queued=False, since_wake=-1)


def _wakes(stream: _Stream, c=None, finished: bool = False) -> bool:
    stream.due = False
    if c is None:
        stream.fail("its worker failed")
    else:
        stream.put(c, 1, finished)
    return stream.due


def test_interval_1_wakes_on_every_output():
    stream = _Stream(interval=1)
    a = completion()
    assert all(_wakes(stream, a) for _ in range(5))


def test_interval_0_wakes_on_first_tokens_ends_and_failures_only():
    stream = _Stream(interval=0)
    a0, a1 = completion(), completion()
    assert _wakes(stream, a0) and _wakes(stream, a1)  # each completion's first token
    assert not any(_wakes(stream, c) for c in (a0, a1, a0))
    assert _wakes(stream, a1, finished=True)
    assert not _wakes(stream, a0)
    assert _wakes(stream)  # a failure
    assert stream.outputs == [a0, a1]  # nothing is dropped, only the wake-ups are: each holds its output


def test_interval_k_wakes_when_a_completion_holds_k_tokens():
    stream = _Stream(interval=3)
    a = completion()
    woke = [_wakes(stream, a) for _ in range(8)]
    # the first token wakes (and is held: 1); the 3rd and the 6th bring what is held to 3
    assert woke == [True, False, True, False, False, True, False, False]
