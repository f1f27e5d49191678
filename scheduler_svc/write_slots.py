"""A bound on a front-end's gRPC writes in flight."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Slot:
    """One write's (or one message batch's) place in the bound; given back once, whichever comes first: the
    writes completed, or the pool's hold time passed."""
    pool: asyncio.Semaphore
    timer: asyncio.TimerHandle | None = None
    held: bool = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.pool.release()
            if self.timer is not None:
                self.timer.cancel()


class WriteSlots:
    """At most `size` writes in flight over all of a front-end's streams. grpc.aio's server takes one new call
    at a time, and each taken call's completion comes through the one completion queue behind a completion per
    write in flight: a front-end writing to each of hundreds of streams took new calls seconds late (`python -m
    bench grpc-accept`), and a pass of the offline workload waited for its last calls. A stream that waits here
    sends all its output so far in one message when its turn comes. A slot held past `hold_s` (a client that
    stopped reading: its write waits for flow control) goes back to the pool while the write goes on, so clients
    that stop reading cannot take the front-end's slots."""

    def __init__(self, size: int, hold_s: float):
        self._pool = asyncio.Semaphore(size)
        self.hold_s = hold_s

    async def take(self) -> Slot:
        await self._pool.acquire()
        slot = Slot(self._pool)
        slot.timer = asyncio.get_running_loop().call_later(self.hold_s, slot.give_back)
        return slot
