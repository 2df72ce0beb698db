"""How long a vLLM engine takes to bring one block up from its host tier, read from its own metrics.

vLLM's CPU offloading (``--kv-offloading-size``: the ``OffloadingConnector``)
counts, per engine core, the seconds it spent loading offloaded KV back onto
the device (``vllm:kv_offload_load_time``), and its scheduler counts the prompt
tokens the connector supplied (``vllm:external_prefix_cache_hits``). Their
ratio, at the engine's block size, is the engine's measured onboard time per
block: the transfer a prefix found only on its host tier costs in ``kv``'s
estimate, in place of an assumed figure. An engine that has onboarded nothing
yet has no measurement (``None``), and the policy's default stands in.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

LOAD_TIME = "vllm:kv_offload_load_time_total"
"""Seconds spent loading offloaded blocks onto the device (a counter)."""
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
"""Prompt tokens a KV connector supplied (a counter)."""
#: The ``/metrics`` samples an ``OnboardMeter`` is read from.
ONBOARD_SAMPLES = (LOAD_TIME, EXTERNAL_HITS)


@dataclass(frozen=True, slots=True)
class OnboardMeter:
    """An engine's onboarding so far, as its counters stand."""

    load_s: float = 0.0
    onboarded_tokens: float = 0.0

    @classmethod
    def of(cls, samples: Mapping[str, float]) -> OnboardMeter:
        """From summed ``/metrics`` samples (``ONBOARD_SAMPLES``; an absent one reads 0)."""
        return cls(samples.get(LOAD_TIME, 0.0), samples.get(EXTERNAL_HITS, 0.0))

    def s_per_block(self, block_size: int) -> float | None:
        """Seconds per onboarded block of ``block_size`` tokens; ``None`` before the first block was onboarded."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size!r}")
        blocks = self.onboarded_tokens / block_size
        return self.load_s / blocks if blocks >= 1 else None
