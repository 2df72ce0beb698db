"""What crosses a process between ranks, routers and monitors: msgpack and plain dataclasses, never torch."""
from kvledger.worker.wire.block_key import BlockHash, BlockKey, MmKey, block_hashes
from kvledger.worker.wire.events import EventBatch, EventDecodeError, KVEvent, decode_batch, encode_batch

__all__ = ["BlockHash", "BlockKey", "EventBatch", "EventDecodeError", "KVEvent", "MmKey", "block_hashes",
           "decode_batch", "encode_batch"]
