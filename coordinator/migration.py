"""KV migration between ranks: a prompt's prefix blocks move from rank A to rank B in one message.

The target allocates first (sharing whatever prefix it already holds), the
source pins the blocks it holds, gathers the ones the target lacks into one
contiguous buffer and sends it; the target receives, scatters into its pool and
stores the blocks in its tree, so they are reusable and announced with
``BlockStored``. Transfers between one pair of ranks never interleave: one lock
per unordered pair.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError

from kvledger.coordinator.cluster import Cluster


@dataclass(frozen=True, slots=True)
class MigrationResult:
    src: int
    dst: int
    matched_blocks: int
    """Full prefix blocks the source held (and pinned)."""
    sent_blocks: int
    """Blocks that crossed the wire (the target already held the others)."""
    bytes: int
    seconds: float
    """Wall time of the transfer itself (send/recv and scatter), after both sides were prepared."""


class Migrator:
    """Moves prefix blocks between the ranks of one cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._locks: dict[frozenset[int], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _pair_lock(self, a: int, b: int) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(frozenset((a, b)), threading.Lock())

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None = None,
                lora_id: int | None = None, cache_salt: str | None = None) -> MigrationResult:
        """Move the prefix blocks of prompt ``tokens`` that ``src`` holds (at most ``max_blocks``) to ``dst``."""
        n = len(self.cluster.actors)
        if not (0 <= src < n and 0 <= dst < n) or src == dst:
            raise ValueError(f"migrate needs two different ranks in 0..{n - 1}, got src={src} dst={dst}")
        tokens = list(tokens)
        A, B = self.cluster.actors[src], self.cluster.actors[dst]
        get = self.cluster.get
        timeout = self.cluster.config.group_timeout_s + 30
        with self._pair_lock(src, dst):
            pin_id, matched = get(A.export_begin.remote(tokens, max_blocks, lora_id, cache_salt))
            if matched == 0:
                get(A.export_end.remote(pin_id))
                return MigrationResult(src, dst, 0, 0, 0, 0.0)
            try:
                import_id, count = get(B.import_begin.remote(tokens, matched, lora_id, cache_salt))
            except BaseException:
                get(A.export_end.remote(pin_id))
                raise
            if count == 0:
                get(A.export_end.remote(pin_id))
                return MigrationResult(src, dst, matched, 0, 0, 0.0)
            t0 = time.perf_counter()
            send = A.export_send.remote(pin_id, matched - count, dst)
            recv = B.import_recv.remote(import_id, src)
            try:
                nbytes, got = get([send, recv], timeout)
            except BaseException:
                for ref in (send, recv):
                    ray.cancel(ref, force=False)
                try:
                    get([A.export_end.remote(pin_id), B.import_abort.remote(import_id)], 30)
                except (GetTimeoutError, ray.exceptions.RayError):
                    pass
                raise
            seconds = time.perf_counter() - t0
            assert got == count, f"rank {dst} stored {got} blocks, {count} were sent"
            return MigrationResult(src, dst, matched, count, nbytes, seconds)
