"""One rank's KV ledger: the books of which KV block lives where, who holds it, and what is reusable.

The cache manager (manager.py) is the admission policy (admission.py over
matching.py, storing.py, scheduling.py) over one window manager per attention
window (window.py), each with its block pool (block_pool.py: blocks, free
lists by eviction order, tier moves, tensors); retention.py gives blocks the
priorities requests ask for, integrity.py proves the books balance. Only the
names below are the ledger's public surface.
"""
from kvledger.worker.ledger.block import NO_BLOCK
from kvledger.worker.ledger.budget import ContextBudget
from kvledger.worker.ledger.config import CacheConfig, PoolLayout, WindowLayout
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.ledger.stats import Admission, KvCacheStats, PinnedPrefix, PrefixReuseSummary, WindowStats
from kvledger.worker.wire.batches import StoredBlock
from kvledger.worker.wire.block_key import BlockHash, BlockKey, MmKey, block_hashes
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.request import DEFAULT_PRIORITY, Request, RetentionConfig, TokenRange

__all__ = [
    "Admission", "BlockHash", "BlockKey", "CacheConfig", "ContextBudget", "DEFAULT_PRIORITY", "KVCacheManager",
    "KvCacheStats", "MmKey", "NO_BLOCK", "OutOfBlocksError", "PinnedPrefix", "PoolLayout", "PrefixReuseSummary",
    "Request", "RetentionConfig", "StoredBlock", "TokenRange", "WindowLayout", "WindowStats", "block_hashes",
]
