"""Whether a host KV tier pays on this worker. A block that comes back from the host is copied while the step
that reads it waits; without the tier its tokens would be prefilled again in that step. So the tier pays where
a block's copy in costs less than prefilling block_size tokens, which depends on the model (FLOPs per token
against KV bytes per token) and the machine (the host link against the GPU's compute). A worker measures both
when it starts (the simulated one reads them off its cost model) and drops a tier that does not pay: every hit
on it would slow the step it feeds, and every block swapped out would cost a copy for nothing. The prefill
measured is the cheapest a block can be (block-sized chunks with nothing before them): a history block deep in
a prompt costs more, by its attention, so the rule keeps a tier only where a copy beats even that, as the copies
also take the host link from the offloads behind them. No torch here: the simulated worker decides with it
too."""
from __future__ import annotations


def host_tier_pays(block_copy_s: float, prefill_s_per_token: float, block_size: int) -> bool:
    return block_copy_s < prefill_s_per_token * block_size
