"""One rank's KV ledger: block keys and hashes, the prefix tree, eviction, tiers, the cache manager."""
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.wire.request import DEFAULT_PRIORITY
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.wire.batches import StoredBlock
from kvledger.worker.wire.request import Request, RetentionConfig, TokenRange
from kvledger.worker.ledger.stats import Admission, KvCacheStats, PrefixReuseSummary
from kvledger.worker.wire.block_key import BlockHash, BlockKey, MmKey, block_hashes

__all__ = [
    "Admission", "BlockHash", "BlockKey", "CacheConfig", "DEFAULT_PRIORITY", "KVCacheManager", "KvCacheStats",
    "MmKey", "OutOfBlocksError", "PrefixReuseSummary", "Request", "RetentionConfig", "StoredBlock", "TokenRange",
    "block_hashes",
]
