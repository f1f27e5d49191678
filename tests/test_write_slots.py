"""The front-end's bound on writes in flight (scheduler_svc/write_slots.py): no more than its size at once, a slot
back when its write ends, and back after the hold time when a write does not end (a client that stopped reading)."""
from __future__ import annotations

import asyncio

from scheduler_svc.write_slots import WriteSlots


def test_at_most_size_writes_hold_slots_and_each_comes_back_once():
    async def run():
        slots = WriteSlots(2, hold_s=60.0)
        a, b = await slots.take(), await slots.take()
        third = asyncio.create_task(slots.take())
        await asyncio.sleep(0.01)
        assert not third.done()  # both slots held
        a.give_back()
        a.give_back()  # once only: the pool does not grow
        c = await asyncio.wait_for(third, 1.0)
        fourth = asyncio.create_task(slots.take())
        await asyncio.sleep(0.01)
        assert not fourth.done()
        b.give_back()
        c.give_back()
        await asyncio.wait_for(fourth, 1.0)
        fifth = await asyncio.wait_for(slots.take(), 1.0)  # b's and c's slots: two free, one taken by fourth
        sixth = asyncio.create_task(slots.take())
        await asyncio.sleep(0.01)
        assert not sixth.done()
        fifth.give_back()
        sixth.cancel()

    asyncio.run(run())


def test_a_slot_held_past_the_hold_time_goes_back_to_the_pool():
    async def run():
        slots = WriteSlots(1, hold_s=0.3)
        stalled = await slots.take()  # its write never ends
        next_one = await asyncio.wait_for(slots.take(), 2.0)  # back after the hold time
        stalled.give_back()  # the stalled write ends at last: it gives back nothing twice
        waiting = asyncio.create_task(slots.take())
        await asyncio.sleep(0.02)
        assert not waiting.done()  # next_one still holds the only slot
        next_one.give_back()
        await asyncio.wait_for(waiting, 1.0)

    asyncio.run(run())
