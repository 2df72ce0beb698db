"""Each engine's speed learned from its answers (``router.engine_rates``), and ``kv`` weighing it."""
from __future__ import annotations

import pytest

from kvledger.router.engine_rates import MIN_SAMPLES, EngineRates
from kvledger.router.policies import KvCostModel, KvPolicy, RankState, RouteRequest


def test_the_prefill_slope_is_fitted_past_the_overhead_and_follows_an_engine_that_slows():
    rates = EngineRates()
    sent = iter(range(0, 10**6, 10))   # one request at a time, far apart: nothing ahead of any
    for i in range(MIN_SAMPLES - 1):
        rates.observe(3, 100 * (i + 1), 1, 0.010 + 100 * (i + 1) * 2e-5, 0.02, next(sent))
    assert rates.rate(3) is None and rates.prefill() == {}   # too few answers: the policy's own figure stands
    for i in range(20):
        computed = 50 + 40 * (i % 10)
        rates.observe(3, computed, 1, 0.010 + computed * 2e-5, 0.05, next(sent))
    assert rates.rate(3).prefill_s_per_token == pytest.approx(2e-5, rel=1e-6)
    for i in range(60):   # another tenant's decodes: every prompt token now takes five times as long
        computed = 50 + 40 * (i % 10)
        rates.observe(3, computed, 1, 0.010 + computed * 1e-4, 0.05, next(sent))
    assert rates.rate(3).prefill_s_per_token == pytest.approx(1e-4, rel=0.05)
    rates.forget(3)
    assert rates.rate(3) is None


def test_streams_teach_the_decode_rate_and_whole_completions_use_it():
    rates = EngineRates()
    for i in range(10):
        rates.observe(0, 200, 11, 0.005 + 200 * 3e-5, 0.005 + 200 * 3e-5 + 10 * 0.002, 10.0 * i)
    r = rates.rate(0)
    assert r.decode_s_per_token == pytest.approx(0.002) and r.samples == 10
    for i in range(30):   # no first chunk: the end less ten decode steps
        computed = 100 + 50 * (i % 5)
        rates.observe(0, computed, 11, None, 0.005 + computed * 3e-5 + 10 * 0.002, 100.0 + 10 * i)
    assert rates.rate(0).prefill_s_per_token == pytest.approx(3e-5, rel=1e-3)


def test_kv_sends_a_miss_to_the_engine_it_learned_is_slower_only_once_it_knows_every_engine():
    prompt = RouteRequest.of(list(range(100, 300)), 16, max_tokens=0)
    cost = KvCostModel(prefill_s_per_token=5e-5, speed_spread=4)
    learned = [RankState(0, prefill_s_per_token=3e-4), RankState(1, queued_prefill_tokens=20, prefill_s_per_token=1e-4)]
    assert KvPolicy(KvCostModel(prefill_s_per_token=5e-5)).route(prompt, learned, {}).rank == 0   # unused by default
    d = KvPolicy(cost).route(prompt, learned, {})
    # speeds relative to the median's (rank 0's here): rank 1 a third of the prior, rank 0 the prior
    assert d.rank == 1 and d.scores == pytest.approx({0: 200 * 5e-5, 1: (20 + 200) * 5e-5 / 3})
    half = [RankState(0, prefill_s_per_token=1e-5), RankState(1, queued_prefill_tokens=20)]
    assert KvPolicy(cost).route(prompt, half, {}).rank == 0   # rank 1 unknown yet: the prior for both
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        RankState(0, prefill_s_per_token=-1.0)
    with pytest.raises(ValueError, match="speed_spread must be >= 1"):
        KvCostModel(speed_spread=0.5)


def test_the_wait_behind_what_an_engine_computes_first_is_not_read_as_slowness():
    """Two engines as fast: one is sent its requests one at a time, the other in bursts of four sent at once, which
    it computes one after another (each first token waits for the one before): both read 2e-5 s per token. An
    answer taken in after a later one's (its start unknown) is left out, not fitted."""
    rates = EngineRates()
    for i in range(32):
        computed = 50 + 40 * (i % 10)
        rates.observe(0, computed, 1, 0.010 + computed * 2e-5, 0.05, 10.0 * i)
    for burst in range(8):
        sent = done = 10.0 * burst
        for k in range(4):
            computed = 50 + 40 * ((4 * burst + k) % 10)
            done += 0.010 + computed * 2e-5
            rates.observe(1, computed, 1, done - sent, done - sent + 0.01, sent)
    for rank in (0, 1):
        assert rates.rate(rank).prefill_s_per_token == pytest.approx(2e-5, rel=1e-6), rank
    samples = rates.rate(1).samples
    rates.observe(1, 100, 1, 0.001, 0.01, 0.0)   # its first token came before the last one fitted
    assert rates.rate(1).samples == samples
