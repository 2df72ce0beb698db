"""A stand-in for a vLLM engine's event publisher, written to vLLM's ZMQ framing, on 127.0.0.1: for tests that
index a vLLM engine's events without starting one (``tests/vllm/`` starts real ones)."""
from __future__ import annotations

import threading
from collections import deque

import msgpack
import zmq

from kvledger.router.vllm_events import END_SEQ

#: The block size the stand-in's events carry.
T = 4


def vllm_stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    """A BlockStored as vLLM 0.33 writes it (map layout, its own hashes)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": T, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}


def vllm_removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


class FakeVllmPublisher:
    """vLLM's ZmqEventPublisher framing: PUB (topic, seq, payload), ROUTER replays ending in the all-ones marker."""

    def __init__(self, buffer_steps: int = 16) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.XPUB)  # XPUB: we can wait for the subscription instead of sleeping
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout_ms: int = 5000) -> None:
        assert self.pub.poll(timeout_ms), "subscriber never subscribed"
        self.pub.recv()

    def publish(self, events: list[dict], send: bool = True) -> int:
        return self.publish_payload(msgpack.packb([1700000000.0 + self.seq, events, 0]), send)

    def publish_payload(self, payload: bytes, send: bool = True) -> int:
        """Publish one batch as encoded elsewhere (a recorded stream); its sequence number."""
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if send:  # send=False: the message is lost on the way, as PUB/SUB allows
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        return seq

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.replay.poll(50):
                continue
            client, _, start = self.replay.recv_multipart()
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    self.replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pub.close(linger=0)
        self.replay.close(linger=0)
