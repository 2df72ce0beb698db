"""One rank's KV ledger: block keys and hashes, the prefix tree, eviction, tiers, the cache manager."""
from worker.block_key import BlockHash, BlockKey, MmKey, block_hashes
from worker.config import DEFAULT_PRIORITY, CacheConfig
from worker.errors import OutOfBlocksError
from worker.manager import KVCacheManager, StoredBlock
from worker.request import Request, RetentionConfig, TokenRange
from worker.stats import Admission, KvCacheStats, PrefixReuseSummary

__all__ = [
    "Admission", "BlockHash", "BlockKey", "CacheConfig", "DEFAULT_PRIORITY", "KVCacheManager", "KvCacheStats",
    "MmKey", "OutOfBlocksError", "PrefixReuseSummary", "Request", "RetentionConfig", "StoredBlock", "TokenRange",
    "block_hashes",
]
