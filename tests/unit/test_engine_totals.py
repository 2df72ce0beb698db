"""A bench's figures from a vLLM server's own counters: every data-parallel core summed, a run's change kept."""
from __future__ import annotations

import pytest

from kvledger.replay.engine_totals import EngineTotals

PAGE = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="tiny"} 600.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 160.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0
vllm:num_preemptions_total{engine="1",model_name="tiny"} 1.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="tiny"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="tiny"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 12.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="tiny"} 4.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 4.0
"""


def test_a_servers_counters_are_summed_over_its_cores_and_a_runs_change_is_kept():
    after = EngineTotals.parse(PAGE)
    # first tokens over SLOW_FIRST_TOKEN_S (1 s): engine 0's 9 less the 6 within it, none of engine 1's
    assert after == EngineTotals(prompt_tokens=1600, cached_tokens=800, requests=9, preemptions=4,
                                 slow_first_tokens=3)
    assert after.hit_rate == pytest.approx(0.5)
    run = after.since(EngineTotals(prompt_tokens=600, cached_tokens=100, requests=2, preemptions=1,
                                   slow_first_tokens=1))
    assert run == EngineTotals(prompt_tokens=1000, cached_tokens=700, requests=7, preemptions=3, slow_first_tokens=2)
    assert EngineTotals().hit_rate == 0.0, "a server that served nothing has no hit rate, not a division by zero"
