"""The router's admission gate on its own: slots, a first-come-first-served queue, refusals that change nothing;
and the bench's figures of what was shed."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvledger.replay.bounds import Bounds
from kvledger.replay.report import GOODPUT_TTFT_S, summarize
from kvledger.replay.simulator import PolicyRun
from kvledger.router.admission import AdmissionGate, AdmissionRefused

WAIT_S = 30.0


def test_the_queue_is_served_in_arrival_order_and_a_full_one_refuses_at_once():
    gate = AdmissionGate(max_inflight=1, max_queued=2, queue_timeout_s=WAIT_S)
    order: list[int] = []
    queued = [threading.Event() for _ in range(2)]
    release = threading.Event()

    def holder() -> None:
        with gate.slot():
            release.wait(WAIT_S)

    def waiter(i: int) -> None:
        queued[i].set()
        with gate.slot():
            order.append(i)

    first = threading.Thread(target=holder)
    first.start()
    threads = [first]
    for i in range(2):
        for _ in range(10_000):   # bounded: until the holder (then waiter i-1) is in
            if gate.counts() == (1, i):
                break
            threading.Event().wait(0.001)
        t = threading.Thread(target=waiter, args=(i,))
        t.start()
        threads.append(t)
        for _ in range(10_000):
            if gate.counts() == (1, i + 1):
                break
            threading.Event().wait(0.001)
    assert gate.counts() == (1, 2)
    with pytest.raises(AdmissionRefused, match="max_queued_completions=2"):
        with gate.slot():
            pytest.fail("a full queue let a request in")
    assert gate.counts() == (1, 2) and gate.refused == 1, "the refusal changed nothing"
    release.set()
    for t in threads:
        t.join(WAIT_S)
    assert order == [0, 1] and gate.counts() == (0, 0)


def test_a_wait_past_the_timeout_is_refused_and_leaves_the_queue():
    gate = AdmissionGate(max_inflight=1, max_queued=4, queue_timeout_s=0.05)
    with gate.slot():
        with pytest.raises(AdmissionRefused, match="no slot within"):
            with gate.slot():
                pytest.fail("no slot was free")
        assert gate.counts() == (1, 0)
    with gate.slot():   # the slot is free again
        assert gate.counts() == (1, 0)


def test_wait_idle_returns_when_the_last_slot_is_given_back_on_another_thread():
    gate = AdmissionGate(max_inflight=2, max_queued=0, queue_timeout_s=WAIT_S)
    held = [gate.hold(), gate.hold()]
    assert not gate.wait_idle(0.01), "two slots are held"
    releaser = threading.Thread(target=lambda: [h.release() for h in held])
    releaser.start()
    assert gate.wait_idle(WAIT_S) and gate.counts() == (0, 0)
    releaser.join(WAIT_S)


def test_the_bench_reports_shed_requests_and_goodput_next_to_ttft():
    ttft = np.array([0.5, GOODPUT_TTFT_S, GOODPUT_TTFT_S + 1, 0.1])
    n = len(ttft)
    run = PolicyRun("p", np.full(n, 10), np.zeros(n, dtype=np.int64), np.full(n, 10), ttft, ttft,
                    np.zeros(n, dtype=np.int64), 0, 0, 0, [1.0], [[1.0]], 1.0, 4.0, 5.0, 8)
    bounds = Bounds(infinite_hit_rate=0.0, pooled_lru_hit_rate=0.0, prompt_tokens=40, infinite_cached_tokens=0,
                    pooled_lru_cached_tokens=0, pooled_lru_capacity_blocks=1)
    s = summarize(run, bounds, 1, shed=3)
    assert s.shed == 3 and s.requests == n
    assert s.goodput_rps == pytest.approx(3 / 4.0), "three of four within the TTFT target, over a 4 s makespan"
    assert summarize(run, bounds, 1).shed == 0
