"""The router indexes a real vLLM engine's events: a publisher written to vLLM's ZMQ framing, on 127.0.0.1."""
from __future__ import annotations


import msgpack
import pytest
import zmq

from kvledger.router.foreign import ForeignFeed
from kvledger.router.groups import WindowedIndex
from kvledger.router.index import PrefixIndex
from kvledger.router.numbering import SequencedIndex
from kvledger.router.probe import match_all_sizes, probe, prompt_hashes
from kvledger.router.vllm_events import VllmEventSubscriber

from fake_vllm import T, FakeVllmPublisher, vllm_removed, vllm_stored
from vllm_engines import free_port

VLLM_RANK = 100


@pytest.fixture
def engine():
    pub = FakeVllmPublisher(buffer_steps=2)
    index = WindowedIndex(tokens_per_block=T)
    sub = VllmEventSubscriber(ForeignFeed(SequencedIndex(index)), VLLM_RANK, f"tcp://127.0.0.1:{pub.pub_port}",
                              replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}")
    pub.wait_subscribed()
    yield pub, index, sub
    sub.close()
    pub.close()


def matched(index: PrefixIndex, tokens: list[int]) -> int:
    m = probe(index, tokens).get(VLLM_RANK)
    return 0 if m is None else m.matched_tokens


def test_vllm_blocks_are_indexed_under_our_hashes_and_removed_by_theirs(engine):
    pub, index, sub = engine
    prompt = list(range(1, 13))
    pub.publish([vllm_stored([0xA1, 0xA2], None, prompt[:8])])
    assert sub.poll_once(5000)
    assert matched(index, prompt[:8] + [0]) == 8
    pub.publish([vllm_stored([0xA3], 0xA2, prompt[8:12])])
    assert sub.poll_once(5000)
    assert matched(index, prompt + [0]) == 12
    pub.publish([vllm_removed([0xA2])])
    assert sub.poll_once(5000)
    assert matched(index, prompt + [0]) == 4  # the chain breaks at the removed block
    assert sub.stats.batches_applied == 3


def test_a_lost_last_batch_is_fetched_once_the_engine_is_quiet():
    """Nothing after it shows the gap (an engine's first batch, sent before the subscription took effect): the
    subscriber asks the replay socket after ``quiet_check_s`` of silence."""
    pub = FakeVllmPublisher()
    index = WindowedIndex(tokens_per_block=T)
    sub = VllmEventSubscriber(ForeignFeed(SequencedIndex(index)), VLLM_RANK, f"tcp://127.0.0.1:{pub.pub_port}",
                              replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}", quiet_check_s=0.2)
    try:
        pub.wait_subscribed()
        prompt = list(range(40, 48))
        pub.publish([vllm_stored([0xC1, 0xC2], None, prompt)], send=False)   # lost, and the engine goes quiet
        for _ in range(50):   # bounded: 50 polls of 50 ms, well past quiet_check_s
            if matched(index, prompt + [0]) == 8:
                break
            assert not sub.poll_once(50)
        assert matched(index, prompt + [0]) == 8
        assert sub.stats.batches_replayed == 1 and sub.stats.quiet_checks >= 1
        checks = sub.stats.quiet_checks
        for _ in range(10):   # quiet again: checks find nothing new and apply nothing twice
            sub.poll_once(50)
        assert sub.stats.batches_replayed == 1 and sub.stats.quiet_checks > checks
    finally:
        sub.close()
        pub.close()


def test_a_lost_batch_is_replayed(engine):
    pub, index, sub = engine
    prompt = list(range(20, 32))
    pub.publish([vllm_stored([0xB1], None, prompt[:4])])
    assert sub.poll_once(5000)
    pub.publish([vllm_stored([0xB2], 0xB1, prompt[4:8])], send=False)  # lost
    pub.publish([vllm_stored([0xB3], 0xB2, prompt[8:12])])
    assert sub.poll_once(5000)
    assert sub.stats.batches_replayed == 1
    assert matched(index, prompt + [0]) == 12


def test_a_replay_that_cannot_reach_back_resets_the_rank(engine):
    pub, index, sub = engine
    prompt = list(range(40, 52))
    pub.publish([vllm_stored([0xC1], None, prompt[:4])])
    assert sub.poll_once(5000)
    for _ in range(3):  # lost, and pushed out of the 2-batch replay buffer
        pub.publish([vllm_stored([0xD1], None, [9, 9, 9, 9])], send=False)
    pub.publish([vllm_stored([0xC9], None, prompt[4:8])])
    assert sub.poll_once(5000)
    assert sub.stats.resets == 1
    assert matched(index, prompt + [0]) == 0  # the old holdings were dropped; the new chain has no known root
    assert matched(index, prompt[4:8] + [0]) == 4


def test_malformed_payloads_are_counted_not_applied(engine):
    pub, index, sub = engine
    pub.pub.send_multipart((b"", (0).to_bytes(8, "big"), b"\xc1garbage"))
    assert sub.poll_once(5000)
    assert sub.stats.batches_malformed == 1 and sub.stats.batches_applied == 0
    assert sub.feed.rejections.by_rank() == {VLLM_RANK: {"malformed": 1}}
    pub.seq = 1   # the next batch follows the rejected one: its number was kept, nothing is replayed
    prompt = list(range(60, 68))
    pub.publish([vllm_stored([0xE1, 0xE2], None, prompt)])
    assert sub.poll_once(5000)
    assert matched(index, prompt + [0]) == 8 and sub.stats.batches_replayed == 0


def test_an_engine_at_another_block_size_is_indexed_at_its_own_and_a_wrong_one_is_counted(engine, caplog):
    pub, index, sub = engine
    prompt = list(range(70, 82))
    index.set_block_size(VLLM_RANK, 2 * T)   # the engine says 8 tokens per block; the index's default is 4
    pub.publish([vllm_stored([0xF1], None, prompt[:4])])   # block_size 4: not the engine's
    pub.publish([vllm_stored([0xF2], None, prompt[4:8])])
    for _ in range(2):
        assert sub.poll_once(5000)
    assert sub.feed.rejections.by_rank() == {VLLM_RANK: {"block_size": 2}}
    logged = [r.getMessage() for r in caplog.records if "rejected events" in r.getMessage()]
    assert len(logged) == 1 and "block_size 4 differs from the engine's 8 tokens per block" in logged[0]
    good = vllm_stored([0xF3], None, prompt[:8])
    good["block_size"] = 2 * T
    pub.publish([good])
    assert sub.poll_once(5000)
    assert matched_all(index, prompt) == {VLLM_RANK: 8}, "indexed at 8 tokens per block"


def matched_all(index: PrefixIndex, tokens: list[int]) -> dict[int, int]:
    hashes = prompt_hashes(tokens, index.tokens_per_block)
    return {r: m.matched_tokens for r, m in match_all_sizes(index, tokens, hashes).items()}


def test_endpoint_must_be_a_zmq_address():
    with pytest.raises(ValueError, match="ZMQ address"):
        VllmEventSubscriber(ForeignFeed(SequencedIndex(WindowedIndex(tokens_per_block=T))), 1, "127.0.0.1:5557")


def test_a_salted_chain_keeps_its_salt_from_the_first_blocks_extra_keys(engine):
    pub, index, sub = engine
    prompt = list(range(90, 102))
    root = {**vllm_stored([0x51, 0x52], None, prompt[:8]), "extra_keys": [["tenant:acme"], None]}
    child = {**vllm_stored([0x53], 0x52, prompt[8:12]), "extra_keys": [None]}   # vLLM names the salt once
    pub.publish([root])
    pub.publish([child])
    for _ in range(2):
        assert sub.poll_once(5000)
    salted = probe(index, prompt + [0], cache_salt="tenant:acme").get(VLLM_RANK)
    assert salted is not None and salted.matched_tokens == 12, "the child inherited its chain's salt"
    assert matched(index, prompt + [0]) == 0, "unsalted, the same tokens are another prompt"
    lora = {**vllm_stored([0x61], None, prompt[:4]), "lora_name": "adapter", "extra_keys": [["adapter", "s"]]}
    pub.publish([lora])
    assert sub.poll_once(5000)
    assert probe(index, prompt[:4] + [0], cache_salt="s").get(VLLM_RANK).matched_tokens == 4, "after the LoRA name"


def test_a_subscriber_that_binds_the_engines_endpoint_binds_it_again_when_it_resubscribes():
    """A connecting engine that comes back with another replay socket still publishes to the endpoint the
    subscriber binds. Its own socket, just closed, may hold the port a moment longer (ZMQ lets go on its I/O
    thread): that is waited out, never taken for the engine having bound it (then nobody would listen)."""
    replayer = FakeVllmPublisher()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = WindowedIndex(tokens_per_block=T)
    sub = VllmEventSubscriber(ForeignFeed(SequencedIndex(index)), VLLM_RANK, endpoint, bind=None)
    engine = zmq.Context.instance().socket(zmq.XPUB)   # XPUB: it sees the subscription arrive
    try:
        assert sub.bound
        replay = f"tcp://127.0.0.1:{replayer.replay_port}"
        for i in range(400):   # bounded; an immediate rebind found the port still held 4 times in 500 here
            sub.resync(endpoint, replay if i % 2 == 0 else None, bind=None)
            sub.poll_once(0)
            assert sub.bound, f"resubscription {i} connected instead of binding its own endpoint"
        engine.connect(endpoint)
        for _ in range(200):   # bounded, 200 x 20 ms: the SUB takes the new pipe (and subscribes) when polled
            sub.poll_once(10)
            if engine.poll(10):
                break
        assert engine.poll(0), "the subscriber's bound socket never heard the engine connect"
        engine.recv()
        prompt = list(range(110, 118))
        engine.send_multipart((b"", (0).to_bytes(8, "big"),
                               msgpack.packb([1700000000.0, [vllm_stored([0x71, 0x72], None, prompt)], 0])))
        assert sub.poll_once(5000)
        assert matched(index, prompt + [0]) == 8
    finally:
        engine.close(linger=0)
        sub.close()
        replayer.close()
