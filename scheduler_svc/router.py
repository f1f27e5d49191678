"""Which worker group gets a new request: the lowest cost of prefill work left to do after its prefix cache,
plus its load, so hot prefixes go where they are cached without piling onto one group.

Load is what this front-end's own requests hold on the group: their tokens (prompt and generated so far, i.e.
the KV they hold or will hold once admitted), times the number of front-ends. A front-end knows its own
requests exactly and at once, and every front-end balancing its own share balances the sum; what the engines
publish lags by the messages in flight, and in a burst every front-end saw the same stale counters and sent
the excess to the groups whose engines had acknowledged least (bench/NOTES.md, "Routing"). Tokens, not
requests: a request weighs its prompt while queued and its KV once it runs, which is also what each decode step
reads and what preemption frees, as in Dynamo's KV router (prefill blocks + active blocks). A group that runs
slower keeps its requests longer and so draws fewer new ones.

The prefix-cache side does come from the engines: a mirror of each group's cache index from its
block-stored / block-removed events, behind the engine by at most the message in flight. A request whose
prefix was stored in the last step can miss that overlap and go where load says (fewer cached tokens, the
same output)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from scheduler_svc.prefix_hash import PromptHashes


@dataclass(slots=True)
class GroupInfo:
    """A worker group as the supervisor announces it (one Execute stream to one worker, at one epoch)."""
    group_id: int
    engine: int  # the engine process that drives it
    address: str
    model: str
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    epoch: int
    kv_cache_dtype: str
    projection_dtype: str = ""  # its projections' weights: the model's dtype, float8_e4m3fn or int4 / int8 / int2
    num_host_blocks: int = 0
    sliding_window: int = 0
    hidden_size: int = 0  # of its embeddings
    embedding_only: bool = False  # no LM head: Embed only
    lora_adapters: list[str] = field(default_factory=list)  # LoRA adapters its worker serves, by name
    labels: list[str] = field(default_factory=list)  # a sequence classifier's (Classify); empty: not one
    label_activation: str = ""  # how its logits become probabilities: sigmoid or softmax
    label_pooling: str = "last"  # the token its head reads: the last, or an encoder's first ("cls")
    weights_path: str = ""  # the folder its weights came from (DescribeResponse.weights_path, then UpdateWeights)
    weight_version: str = ""  # the name UpdateWeights gave them (default: weights_path)
    draining: bool = False


@dataclass(slots=True, eq=False)
class GroupView:
    info: GroupInfo
    hashes: set[int] = field(default_factory=set)  # the group's cached blocks, by chained hash
    own_tokens: int = 0  # tokens of this front-end's completions on it (Completion.move_to keeps it)
    # its engine's last report, over every front-end's requests
    waiting: int = 0
    waiting_tokens: int = 0
    running: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    preemptions: int = 0
    num_requests: int = 0
    weight_version: str = ""  # of the weights that computed the tokens its engine sent last

    def __post_init__(self) -> None:
        self.free_blocks = self.info.num_blocks  # until its engine's first report
        self.weight_version = self.info.weight_version

    @property
    def group_id(self) -> int:
        return self.info.group_id

    @property
    def address(self) -> str:
        return self.info.address

    def report(self, load: list, events: list | None, stored, removed) -> None:
        """The engine's report: its load and prefix-cache events."""
        (self.waiting, self.waiting_tokens, self.running, self.free_blocks, self.cached_blocks, self.preemptions,
         self.num_requests, self.weight_version) = load
        if events is not None:
            if len(events) > 2:  # a snapshot: the whole index
                self.hashes = set(stored)
            else:
                self.hashes.update(stored)
                self.hashes.difference_update(removed)

    def cached_prefix_tokens(self, hashes: PromptHashes) -> int:
        """Tokens of the prompt its prefix cache holds in either tier (as last reported), never the last one."""
        bs = self.info.block_size
        of = hashes.of(bs)
        limit = (len(hashes.token_ids) - 1) // bs
        n = 0
        cached = self.hashes
        while n < limit and of[n] in cached:
            n += 1
        return n * bs


class Group(Protocol):
    own_tokens: int
    free_blocks: int

    def cached_prefix_tokens(self, hashes: PromptHashes) -> int: ...


G = TypeVar("G", bound=Group)


def cost(group: Group, hashes: PromptHashes, frontends: int) -> float:
    """Prefill left after the group's cache, plus the tokens all front-ends' requests hold there (this one's
    times their number); free blocks break ties."""
    uncached = len(hashes.token_ids) - group.cached_prefix_tokens(hashes)
    return uncached + frontends * group.own_tokens - 1e-6 * group.free_blocks


def serving(groups: list[GroupView], lora: str) -> list[GroupView]:
    """The groups a request under the LoRA adapter `lora` ("": none) may go to: those that serve it (while one is
    loaded or unloaded, or where a group that joined could not load it, the groups differ)."""
    return [g for g in groups if not lora or lora in g.info.lora_adapters]


def pick_group(groups: list[G], hashes: PromptHashes, frontends: int) -> G:
    return min(groups, key=lambda g: cost(g, hashes, frontends))
