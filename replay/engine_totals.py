"""What a vLLM server counted itself, from its ``/metrics``: the figures a bench trusts over any router's claim.

A bench reads each server's totals before and after a run and keeps the
difference (``EngineTotals.since``): prompt tokens and prefix-cache hits (the
hit rate), finished requests (the split over the engines), the seconds its
requests spent being served (``vllm:request_inference_time_seconds``, the
engine's work) and the requests it preempted for want of KV blocks (each computed
again). Counters of every data-parallel core are summed.
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_SAMPLES = {"vllm:prompt_tokens_total": "prompt_tokens", "vllm:prefix_cache_hits_total": "cached_tokens",
            "vllm:request_success_total": "requests", "vllm:request_inference_time_seconds_sum": "busy_s",
            "vllm:external_prefix_cache_hits_total": "external_tokens", "vllm:num_preemptions_total": "preemptions"}


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

    @classmethod
    def parse(cls, metrics_text: str) -> EngineTotals:
        values = dict.fromkeys(_SAMPLES.values(), 0.0)
        for family in text_string_to_metric_families(metrics_text):
            for s in family.samples:
                if (field := _SAMPLES.get(s.name)) is not None:
                    values[field] += s.value
        return cls(**values)

    @classmethod
    def read(cls, client: httpx.Client, url: str) -> EngineTotals:
        r = client.get(f"{url}/metrics")
        r.raise_for_status()
        return cls.parse(r.text)

    def since(self, before: EngineTotals) -> EngineTotals:
        return EngineTotals(self.prompt_tokens - before.prompt_tokens, self.cached_tokens - before.cached_tokens,
                            self.requests - before.requests, self.busy_s - before.busy_s,
                            self.external_tokens - before.external_tokens, self.preemptions - before.preemptions)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


__all__ = ["EngineTotals"]
