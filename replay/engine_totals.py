"""What a vLLM server counted itself, from its ``/metrics``: the figures a bench trusts over any router's claim.

A bench reads each server's totals before and after a run and keeps the
difference (``EngineTotals.since``): prompt tokens and prefix-cache hits (the
hit rate), finished requests (the split over the engines), the seconds its
requests spent being served (``vllm:request_inference_time_seconds``, the
engine's work), the requests it preempted for want of KV blocks (each computed
again) and the first tokens it was slow to give (over ``SLOW_FIRST_TOKEN_S`` by its
own clock, ``vllm:time_to_first_token_seconds``: a stall the engine saw, not one
only a router or client saw). Counters of every data-parallel core are summed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import httpx
from prometheus_client.parser import text_string_to_metric_families

_SAMPLES = {"vllm:prompt_tokens_total": "prompt_tokens", "vllm:prefix_cache_hits_total": "cached_tokens",
            "vllm:request_success_total": "requests", "vllm:request_inference_time_seconds_sum": "busy_s",
            "vllm:external_prefix_cache_hits_total": "external_tokens", "vllm:num_preemptions_total": "preemptions"}
#: A first token the engine gave later than this after the request arrived counts as slow (one of vLLM's bucket
#: bounds of ``vllm:time_to_first_token_seconds``, so the count is exact).
SLOW_FIRST_TOKEN_S = 1.0
_TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"


@dataclass(frozen=True, slots=True)
class EngineTotals:
    """One server's counters (or their change over a run)."""

    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    """Prompt tokens its prefix cache served."""
    requests: float = 0.0
    """Requests finished, for any reason."""
    busy_s: float = 0.0
    """Seconds its requests spent from scheduled to finished, summed."""
    external_tokens: float = 0.0
    """Prompt tokens its KV connector supplied (another server computed them: a prefill handed over)."""
    preemptions: float = 0.0
    """Requests it preempted because its KV blocks ran out (vLLM computes a preempted request's KV again)."""
    slow_first_tokens: float = 0.0
    """Requests whose first token it gave over ``SLOW_FIRST_TOKEN_S`` after their arrival, by its own clock."""

    @classmethod
    def parse(cls, metrics_text: str) -> EngineTotals:
        values = dict.fromkeys(_SAMPLES.values(), 0.0)
        slow = 0.0
        for family in text_string_to_metric_families(metrics_text):
            for s in family.samples:
                if (field := _SAMPLES.get(s.name)) is not None:
                    values[field] += s.value
                elif s.name == _TTFT_BUCKET:   # cumulative: all of them, less those within the bound
                    le = float(s.labels["le"])
                    if le == math.inf:
                        slow += s.value
                    elif le == SLOW_FIRST_TOKEN_S:
                        slow -= s.value
        return cls(**values, slow_first_tokens=slow)

    @classmethod
    def read(cls, client: httpx.Client, url: str) -> EngineTotals:
        r = client.get(f"{url}/metrics")
        r.raise_for_status()
        return cls.parse(r.text)

    def since(self, before: EngineTotals) -> EngineTotals:
        return EngineTotals(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


__all__ = ["SLOW_FIRST_TOKEN_S", "EngineTotals"]
