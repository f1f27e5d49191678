"""A reload of one worker group's weights from another checkpoint of its model while it serves (SGLang's
update_weights_from_disk: a trainer hands its new weights to the engine that samples from them).

Every sequence the group holds when the reload is asked for finishes on the weights it started with; sequences added
later are not admitted until the reload is answered, and then run on the new weights, so that no sequence mixes the
two. Once the first have finished, one plan carries the folder (StepPlan.load_weights) to a worker that holds no
sequence, and the scheduler forgets every cached block first, in both tiers (their KV came from the old weights).
The worker answers in that step's result (StepResult.failed_weights: it serves the weights it had), which ends the
reload in one WeightsOutcome for whoever drives the group."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WeightsUpdate:
    path: str
    ticket: object         # the asker's, handed back
    before: set[int]       # the sequences it waits for: those the group held when it was asked, until they finish
    step: int = 0          # the plan that carries it (0: not planned yet)


@dataclass(slots=True)
class WeightsOutcome:
    path: str
    ticket: object
    error: str = ""        # empty: the worker serves the new weights
