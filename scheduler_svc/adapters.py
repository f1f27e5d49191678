"""The LoRA adapters of one worker group, as its scheduler tracks them: which ones requests may run under, which of
them the worker holds in host memory and in its slots, and the loads and unloads asked for while serving. All reach
the worker as plan deltas (StepPlan.load_loras, unload_loras, lora_slots) like everything else it does.

The worker holds up to `capacity` adapters in host memory (DescribeResponse.max_cpu_loras) and copies one into a
slot (max_loras) when the scheduler places it there: a sequence runs under an adapter in a slot, so a step runs
under at most as many adapters as there are slots, and more may be held. More still may be served, as vLLM serves
them: an adapter is known by the folder it was read from (DescribeResponse.lora_paths for those the worker holds at
the handshake), and one that has to make room for another is dropped from host memory (StepPlan.drop_loras), the least
recently used of those no running sequence needs, and read from its folder again when a sequence is admitted under
it. The worker keeps a dropped adapter's folder and names it at the next handshake (DescribeResponse.dropped_loras), so
a scheduler that connects anew serves it still. A sequence is admitted
once its adapter is held and has a slot: a free one, else the least recently used one that no running sequence
needs (`place`); a sequence whose adapter has neither waits, and so do the adapter sequences behind it, so that a
stream of requests under the placed adapters cannot starve another adapter's. An adapter moved out of a slot or
dropped from host memory keeps its cached KV: its folder holds the same weights when it comes back. One that cannot
be read again is lost: it is no longer served, and the sequences that waited for it leave (`lost`).

A load is planned at once; requests may run under it once the worker answered that step (a failed load comes back
in StepResult.failed_loras). An unload stops new requests under the adapter at once, and is planned once no sequence
of the group runs or waits under it (the worker drops finished sequences before the plan's unloads); the scheduler
then forgets the cached blocks no sequence holds (BlockManager.forget_free), among them all the adapter's, since a
later load under the name may bring other weights. Each request ends in one AdapterOutcome, taken by whoever drives
the group (the engine answers its asker)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


class AdapterError(ValueError):
    """A load or unload refused at once; `code` names its gRPC status."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class AdapterOutcome:
    name: str
    ticket: object   # the asker's, handed back
    error: str = ""  # empty: done
    code: str = ""   # the error's gRPC status name


@dataclass(slots=True)
class _Op:
    kind: str        # "load" and "unload" are asked for; "reload" (a waiting sequence needs it back), "drop" (room)
    name: str
    path: str = ""
    ticket: object = None


@dataclass(slots=True)
class AdapterPlan:
    """What one step's plan does to the adapters."""
    unloads: list[str] = field(default_factory=list)               # no longer served: out of host memory and slot
    drops: list[str] = field(default_factory=list)                 # out of host memory for room, still served
    loads: list[tuple[str, str]] = field(default_factory=list)     # (name, folder) read into host memory
    placements: list[tuple[int, str]] = field(default_factory=list)  # (slot, name) copied from host memory
    forget_kv: bool = False  # an adapter was unloaded: its cached KV must not be hit under a later load of the name


class Adapters:
    def __init__(self, served: list[str], slots: list[str], capacity: int = 0, paths: list[str] | None = None,
                 dropped: dict[str, str] | None = None):
        """served: the adapters the worker holds (DescribeResponse.lora_adapters) and paths the folders it read them
        from (lora_paths; "" or none: never dropped for room); slots: the adapter in each of its slots, "" where
        free (lora_slots); capacity: how many it may hold (max_cpu_loras; 0: as many as slots); dropped: those it
        dropped for room before and serves still (dropped_loras -> dropped_lora_paths), read again when needed."""
        dropped = dropped or {}
        self.served = [*served, *dropped]  # requests may run under these
        # of the served ones, and those being loaded
        self.paths = {**dict(zip(served, paths or [""] * len(served))), **dropped}
        self.held = set(served)     # in the worker's host memory, as the plans so far leave it
        self.slots = list(slots)    # as the plans so far leave them
        self.capacity = max(capacity, len(slots))
        self.num_placements = 0     # adapters copied into a slot for a sequence
        self.num_reloads = 0        # adapters read again for a sequence, after they made room for others
        self.lost: list[tuple[str, str]] = []  # (adapter, why) that could not be read again, until taken
        self._used: dict[str, int] = {}  # adapter -> the last step that admitted a sequence under it
        self._placing: list[tuple[int, str]] = []  # this plan's
        self._waiting: list[_Op] = []  # not planned yet
        self._planned: deque[tuple[int, list[_Op]]] = deque()  # (step, its loads and unloads), oldest first
        self.outcomes: list[AdapterOutcome] = []

    @property
    def pending(self) -> bool:
        """A load or unload is waiting for a plan or for its step's result, or a placement for its plan."""
        return bool(self._waiting or self._planned or self._placing)

    def _busy(self, name: str, kinds: tuple[str, ...] = ("load", "unload", "reload", "drop")) -> bool:
        """Whether an op of these kinds on the adapter waits for a plan or for its step's answer."""
        return any(op.name == name and op.kind in kinds for op in self._waiting) or any(
            op.name == name and op.kind in kinds for _, ops in self._planned for op in ops)

    def load(self, name: str, path: str, ticket: object = None) -> None:
        """Asks for the adapter at path (a folder on the worker's file system) under name. AdapterError:
        FAILED_PRECONDITION where the worker has no slots, ALREADY_EXISTS where the name is served or busy. Where the
        worker holds all it may, the plan drops the least recently used adapter no sequence needs; with none, the
        outcome is RESOURCE_EXHAUSTED."""
        if not self.slots:
            raise AdapterError("FAILED_PRECONDITION", "the worker has no LoRA slots (its --max-loras)")
        if name in self.served or self._busy(name):
            raise AdapterError("ALREADY_EXISTS", f"LoRA adapter {name!r} is loaded already (or being loaded or "
                                                 "unloaded)")
        self._waiting.append(_Op("load", name, path, ticket))

    def unload(self, name: str, ticket: object = None) -> None:
        """Stops new requests under the adapter; it is dropped once none runs under it. AdapterError NOT_FOUND
        where it is not served."""
        if name not in self.served:
            raise AdapterError("NOT_FOUND", f"LoRA adapter {name!r} is not loaded")
        self.served.remove(name)
        self._waiting.append(_Op("unload", name, ticket=ticket))

    def update(self, name: str, path: str, ticket: object = None) -> None:
        """load(name, path), or unload(name) where path is "": how the tree's messages carry both."""
        if path:
            self.load(name, path, ticket)
        else:
            self.unload(name, ticket)

    def place(self, name: str, step: int, needed: Callable[[], set[str]]) -> bool:
        """Whether the adapter is held and has a slot in `step`'s plan for a sequence about to be admitted under it:
        the one it is in, a free one, or the least recently used one of an adapter no running sequence needs
        (`needed()`: the adapters of the running sequences, those admitted into this plan among them). One dropped
        for room is asked back: the sequence waits for that step's answer."""
        self._used[name] = step
        if self._busy(name, ("load", "reload")):
            return False
        if name not in self.held:
            self._waiting.append(_Op("reload", name, self.paths[name]))
            return False
        if name in self.slots:
            return True
        if "" in self.slots:
            slot = self.slots.index("")
        else:
            busy = needed()
            idle = [i for i, held in enumerate(self.slots) if held not in busy]
            if not idle:
                return False
            slot = min(idle, key=lambda i: self._used.get(self.slots[i], -1))
        self.slots[slot] = name
        self._placing.append((slot, name))
        self.num_placements += 1
        return True

    def take(self, step: int, holds: Callable[[str], bool], needed: set[str]) -> AdapterPlan:
        """The plan of `step`'s unloads (of adapters no sequence holds: `holds(name)`), loads, the drops that make
        room for them (of adapters no running sequence needs: `needed`) and placements."""
        plan = AdapterPlan(placements=self._placing)
        self._placing = []
        ops, self._waiting = self._waiting, []
        planned: list[_Op] = []
        for op in ops:
            if op.kind == "unload":
                if holds(op.name) or any(o.name == op.name for _, step_ops in self._planned for o in step_ops):
                    self._waiting.append(op)
                    continue
                plan.forget_kv = True
                on_worker = self.paths.pop(op.name, None) is not None  # held, or dropped and its folder kept there
                self._used.pop(op.name, None)
                if not on_worker:  # lost while the unload waited (its folder could not be read again)
                    self.outcomes.append(AdapterOutcome(op.name, op.ticket))
                    continue
                if op.name in plan.drops:  # dropped for room by this same plan: unloaded instead
                    plan.drops.remove(op.name)
                self._out(op, plan, planned)  # also one dropped for room before: the worker keeps its folder
                continue
            if op.kind == "reload" and not holds(op.name):  # its sequences are gone
                continue
            if len(self.held) >= self.capacity and not self._make_room(holds, needed, plan, planned):
                if op.kind == "load" and all(name in needed or not self.paths.get(name) for name in self.held):
                    self.outcomes.append(AdapterOutcome(
                        op.name, op.ticket, f"each of the {self.capacity} LoRA adapters the worker holds (its "
                        "--max-cpu-loras) runs a request now: try again, or hold more than --max-loras",
                        "RESOURCE_EXHAUSTED"))
                else:  # room comes once an adapter's load, unload or running sequences are over
                    self._waiting.append(op)
                continue
            self.held.add(op.name)
            self.paths[op.name] = op.path
            self.num_reloads += op.kind == "reload"
            plan.loads.append((op.name, op.path))
            planned.append(op)
        if planned:
            self._planned.append((step, planned))
        return plan

    def _make_room(self, holds: Callable[[str], bool], needed: set[str], plan: AdapterPlan,
                   planned: list[_Op]) -> bool:
        """Drops the least recently used held adapter that can be read again and no running sequence needs,
        preferring one no sequence waits for; False where there is none."""
        idle = [name for name in self.held if name not in needed and self.paths.get(name)
                and not self._busy(name, ("load", "reload")) and all(op.name != name for op in planned)]
        if not idle:
            return False
        victim = min(idle, key=lambda name: (holds(name), self._used.get(name, -1)))
        self._out(_Op("drop", victim), plan, planned)
        return True

    def _out(self, op: _Op, plan: AdapterPlan, planned: list[_Op]) -> None:
        self.held.discard(op.name)
        if op.name in self.slots:
            self.slots[self.slots.index(op.name)] = ""
        (plan.drops if op.kind == "drop" else plan.unloads).append(op.name)
        planned.append(op)

    def answered(self, step: int, failed: dict[str, str]) -> None:
        """The worker answered `step`: its loads serve unless `failed` names them (with why)."""
        if not self._planned or self._planned[0][0] != step:
            return
        for op in self._planned.popleft()[1]:
            error = failed.get(op.name, "") if op.kind in ("load", "reload") else ""
            if error:
                self.held.discard(op.name)
                self.paths.pop(op.name, None)
            if op.kind == "reload" and error:
                if op.name in self.served:
                    self.served.remove(op.name)
                self.lost.append((op.name, error))
            if op.kind in ("reload", "drop"):
                continue
            if op.kind == "load" and not error:
                self.served.append(op.name)
            self.outcomes.append(AdapterOutcome(op.name, op.ticket, error, "INVALID_ARGUMENT" if error else ""))

    def take_outcomes(self) -> list[AdapterOutcome]:
        outcomes, self.outcomes = self.outcomes, []
        return outcomes

    def take_lost(self) -> list[tuple[str, str]]:
        lost, self.lost = self.lost, []
        return lost
