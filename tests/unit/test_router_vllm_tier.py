"""vLLM's host tier in the router: its CPU-offloaded blocks indexed as a second tier per engine, the probe's tokens
per tier, its measured onboard time per block (from its metrics) in ``kv``'s cost, and each data-parallel engine
core's load read from its own ``engine`` label.

The stream is ``tests/data/vllm_tier_events.msgpack``: batches encoded by vLLM 0.32's own event classes and
encoder (``tests/data/record_vllm_tier_events.py``), as its offloading connector publishes them; it reaches the
router over ZMQ in vLLM's framing. vLLM's offloading itself does not start on this CPU build (see the README).
"""
from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from fake_vllm import FakeVllmPublisher

from kvledger.router.config import RouterConfig
from kvledger.router.load import LoadAccount
from kvledger.router.policies import KvCostModel, KvPolicy, RankState, RouteRequest
from kvledger.router.probe import PrefixMatch
from kvledger.router.rejections import UNKNOWN_HASH
from kvledger.router.routing import RouteStep
from kvledger.router.service import RouterService
from kvledger.router.served import RankProbe
from kvledger.router.vllm_onboard import OnboardMeter
from kvledger.router.vllm_server import engine_load

STREAM = Path(__file__).resolve().parent.parent / "data" / "vllm_tier_events.msgpack"
RAW_STREAM = STREAM.with_name("vllm_tier_events_raw.msgpack")
BLOCK = 32
PROMPT = [1, *range(3, 3 + 2 * BLOCK - 1)] + [7]   # the recorded blocks' 64 tokens, then one more
POLL_MS = 5000


@pytest.fixture
def indexed(request):
    """A router indexing one engine's recorded stream (``STREAM``, or the one the test's parameter names; indexed
    only, not routed to), and a way to feed it."""
    pub = FakeVllmPublisher()
    service = RouterService(None, RouterConfig(tokens_per_block=16))
    rank = service.feed.attach_vllm(f"tcp://127.0.0.1:{pub.pub_port}", f"tcp://127.0.0.1:{pub.replay_port}",
                                    block_size=BLOCK)
    pub.wait_subscribed()
    batches = iter(msgpack.unpackb(getattr(request, "param", STREAM).read_bytes()))

    def next_batch() -> dict[int, RankProbe]:
        seq = pub.publish_payload(next(batches))
        since = service.feed.log.next_id
        for _ in range(50):   # bounded: the subscriber applies it within a few polls
            if service.feed.index.next_seq(rank) > seq:
                break
            service.feed.wait_events(since, rank, 100, POLL_MS / 50_000)
        assert service.feed.index.next_seq(rank) == seq + 1, "the batch was not applied"
        return service.probe(PROMPT)

    yield service, rank, next_batch
    service.close()
    pub.close()


def test_offloaded_blocks_are_the_engines_host_tier_and_the_probe_splits_tokens_by_tier(indexed) -> None:
    service, rank, next_batch = indexed
    assert next_batch()[rank] == RankProbe(64, 64, 0), "computed on the device"
    assert next_batch()[rank] == RankProbe(64, 64, 0), "offloaded too: still on the device"
    assert next_batch()[rank] == RankProbe(64, 0, 64), "evicted from the device: on the host tier only"
    assert service.feed.index.store.host_only_blocks(rank) == 2
    assert next_batch()[rank] == RankProbe(32, 0, 32), "the second block evicted from the host too"
    assert service.feed.rejections.by_rank()[rank] == {UNKNOWN_HASH: 1}, "the stray host removal is only counted"
    assert service.feed.index.stats.snapshots_loaded == 0, "and the engine's view never diverged"
    foreign = service.report(refresh=False).foreign
    assert [(f.rank, f.index_blocks, f.host_blocks) for f in foreign] == [(rank, 1, 1)]


@pytest.mark.parametrize("indexed", [RAW_STREAM], indirect=True)
def test_offloaded_hashes_without_tokens_are_host_copies_of_the_blocks_the_engine_holds(indexed) -> None:
    """Without ``self_describing_kv_events`` a host store names a hash only (block size 0): the copy of a block
    the device stored counts on the host tier; one of a hash never stored is skipped and counted, and the rest
    of its batch is applied."""
    service, rank, next_batch = indexed
    assert next_batch()[rank] == RankProbe(64, 64, 0), "computed on the device"
    assert next_batch()[rank] == RankProbe(64, 64, 0), "offloaded too: still on the device"
    assert service.feed.rejections.by_rank()[rank] == {UNKNOWN_HASH: 1}, "the copy of a hash never stored"
    assert next_batch()[rank] == RankProbe(64, 0, 64), "evicted from the device: on the host tier only"
    assert next_batch()[rank] == RankProbe(32, 0, 32), "the second block evicted from the host too"
    assert service.feed.rejections.by_rank()[rank] == {UNKNOWN_HASH: 2}
    assert "malformed" not in service.feed.rejections.by_rank()[rank]


def route(onboard: float | None) -> int:
    """Where ``kv`` sends the prompt: rank 1000 holds its 64 tokens on its host tier only, 1001 nothing."""
    req = RouteRequest.of(PROMPT, BLOCK)
    ranks = [RankState(1000, migratable=False, onboard_s_per_block=onboard), RankState(1001, migratable=False)]
    return KvPolicy(KvCostModel(prefill_s_per_token=5e-5)).route(req, ranks, {1000: PrefixMatch(2, 64, 2)}).rank


def test_a_prefix_on_the_host_tier_only_is_credited_its_prefill_less_the_measured_onboard() -> None:
    assert route(None) == 1000, "unmeasured: the cost model's 8e-5 s per block is cheaper than 64 tokens' prefill"
    assert route(1e-4) == 1000, "measured cheap: copying 2 blocks up beats computing 64 tokens"
    assert route(0.01) == 1001, "measured dear: 20 ms to copy up loses to 3.25 ms of prefill"


def test_the_route_step_hands_each_rank_its_measured_onboard_time() -> None:
    step = RouteStep(KvPolicy(), LoadAccount())
    d = step.decide(RouteRequest.of(PROMPT, BLOCK), {1000: PrefixMatch(2, 64, 2)}, [1000, 1001], {}, 0.0, False,
                    fixed=[1000, 1001], onboard={1000: 0.01, 1001: None})
    assert d.rank == 1001 and {r: s.onboard_s_per_block for r, s in d.loads.items()} == {1000: 0.01, 1001: None}


def test_a_measured_onboard_time_must_be_a_finite_number() -> None:
    for bad in (-1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="onboard_s_per_block"):
            RankState(1000, onboard_s_per_block=bad)


#: ``/metrics`` of a data-parallel server with CPU offloading, in vLLM's names and labels (the queue samples as a
#: DP-2 server printed them here; the offload counters as ``OffloadingConnector`` names them).
METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:kv_offload_load_time counter
vllm:kv_offload_load_time_total{engine="0",model_name="m"} 0.0
vllm:kv_offload_load_time_total{engine="1",model_name="m"} 0.012
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 0.0
vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 1920.0
"""


def test_each_data_parallel_cores_load_and_onboarding_is_read_from_its_own_engine_label() -> None:
    zero, one, both = engine_load(METRICS, 0), engine_load(METRICS, 1), engine_load(METRICS, None)
    assert (zero.waiting, zero.running, zero.kv_usage) == (2, 0, 0.25)
    assert (one.waiting, one.running, one.kv_usage) == (0, 1, 0.5)
    assert (both.waiting, both.running) == (2, 1)
    assert zero.onboard.s_per_block(BLOCK) is None, "nothing onboarded yet: not measured"
    assert one.onboard.s_per_block(BLOCK) == pytest.approx(0.012 / 60), "12 ms for 1920 tokens, 60 blocks"


def test_an_onboard_meter_needs_a_whole_block_onboarded() -> None:
    assert OnboardMeter(0.001, 31.0).s_per_block(BLOCK) is None
    assert OnboardMeter(0.002, 64.0).s_per_block(BLOCK) == pytest.approx(0.001)
    with pytest.raises(ValueError, match="block_size"):
        OnboardMeter().s_per_block(0)
