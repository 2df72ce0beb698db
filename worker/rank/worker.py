"""One rank: its ledger, the batch scheduler and engine that serve through it, its process group, migration
endpoints and event batches.

``RankWorker`` is a plain class (unit-testable without Ray) that puts the
rank's parts together; each method hands the call to the part that owns it.
Two clients call it, each method by its name in a typed client: the Ray actor
(``actor.py``: this class plus a few node-level methods and the router's event
pushes) through ``kvledger.coordinator.rank_client.RayRankClient``, and
``InProcessRankClient`` (``kvledger.coordinator.local_cluster``) directly.
Each part lives in a module of its own: the books, their lock and the armed
crash points (``books``, ``faults``), the running batch and its load report
(``serving``, ``scheduler``), the process group (``process_group``), the
migration endpoints (``transfer``), the numbered event batches
(``publisher``) and the thread that pushes them (``pusher``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from kvledger.worker.device import resolve_device
from kvledger.worker.engine.reference import MODEL_NAME, TOKENIZER, ReferenceEngine
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.rank.books import RankBooks
from kvledger.worker.rank.process_group import ProcessGroup
from kvledger.worker.rank.pusher import EventPusher
from kvledger.worker.rank.scheduler import BatchingConfig
from kvledger.worker.rank.serving import RankServer
from kvledger.worker.rank.transfer import PrefixMoved, TransferEndpoints
from kvledger.worker.wire.batches import PublishedBatch, Snapshot, StoredBlock
from kvledger.worker.wire.messages import ExportTicket, ImportTicket, RankInfo, RankLoad, ServeReply
from kvledger.worker.wire.request import Request


class RankWorker:
    """One rank of ``world_size`` (see the module docstring).

    It starts without a ledger: the block counts are agreed over the group first (``agree_block_counts``, or
    ``build_ledger`` where there is no group), and until then a call that needs the ledger raises
    ``RankNotReadyError`` (a restarted actor is in that state too, until the group is formed again).
    """

    def __init__(self, rank: int, world_size: int, cache: CacheConfig, seed: int = 0,
                 gpu_memory_fraction: float = 0.5, replay_size: int = 1024,
                 batching: BatchingConfig = BatchingConfig()) -> None:
        if not isinstance(rank, int) or not isinstance(world_size, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in 0..world_size-1, got rank={rank!r} world_size={world_size!r}")
        self.rank, self.world_size = rank, world_size
        self.template = cache
        self.seed = seed
        self.replay_size = replay_size
        self.batching = batching
        self.device = resolve_device(cache.device)
        self.books = RankBooks(rank, cache, self.device, gpu_memory_fraction, replay_size)
        self.engine = ReferenceEngine(cache, seed=seed)
        self.server = RankServer(self.books, self.engine, batching)
        self.group = ProcessGroup(rank, world_size, self.device)
        self.transfers = TransferEndpoints(self.books)
        self.pusher = EventPusher(self.books)

    @property
    def manager(self) -> KVCacheManager | None:
        """The ledger, once the block counts are agreed."""
        return self.books.manager

    # ------------------------------------------------------------------ budget and process group

    def local_block_counts(self) -> tuple[int, ...]:
        return self.books.local_block_counts()

    def build_ledger(self, num_primary: int, num_secondary: int, *more_windows: int) -> tuple[int, ...]:
        return self.books.build(num_primary, num_secondary, *more_windows)

    def open_store(self, host: str, timeout_s: float) -> int:
        return self.group.open_store(host, timeout_s)

    def join_group(self, host: str, port: int, timeout_s: float, generation: int = 0) -> str:
        return self.group.join(host, port, timeout_s, generation)

    def leave_group(self) -> None:
        self.group.leave()

    def agree_block_counts(self) -> tuple[int, ...]:
        """All-reduce MIN of this rank's block counts (per attention window) over the group, then build the ledger
        with the result."""
        counts = self.group.all_reduce_min(self.local_block_counts())
        if min(counts[::2]) <= 0:
            raise RuntimeError(f"the agreed device-tier block counts are {counts[::2]}: some rank has no budget")
        return self.books.build(*counts)

    # ------------------------------------------------------------------ serving and reports

    def serve(self, requests: Sequence[Request], logits: bool = False, publish: bool = False) -> ServeReply:
        return self.server.serve(requests, logits, publish)

    def abort(self, request_ids: Sequence[int]) -> list[int]:
        """Abort queued or running requests (a client that went away); the ids that were still in."""
        return self.server.scheduler.abort(request_ids)

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> int:
        return self.server.probe(tokens, lora_id, cache_salt)

    def load(self) -> RankLoad:
        return self.server.load(publishing=self.pusher.running)

    def info(self) -> RankInfo:
        """Device, process group and block counts of this rank."""
        mgr = self.books.manager
        return RankInfo(self.rank, str(self.device), self.group.backend, self.group.joined, mgr is not None,
                        self.template.tokens_per_block, 0 if mgr is None else mgr.num_primary,
                        0 if mgr is None else mgr.num_secondary, dataclasses.asdict(self.transfers.counts),
                        MODEL_NAME, TOKENIZER, None if mgr is None else mgr.context_limit(),
                        () if mgr is None else tuple((lay.window, d, h) for lay, (d, h)
                                                     in zip(mgr.config.window_layouts, mgr.window_block_counts)))

    def snapshot(self) -> list[StoredBlock]:
        with self.books.lock:
            return self.books.ledger().snapshot()

    def check_integrity(self) -> None:
        with self.books.lock:
            self.books.ledger().check_integrity()

    def arm_crash(self, point: str, after: int = 1) -> dict[str, int]:
        """Crash this rank's process the ``after``-th time it reaches ``point`` (``faults.CrashPoint``); the
        points armed now."""
        self.books.faults.arm(point, after)
        return self.books.faults.armed()

    # ------------------------------------------------------------------ events for routers

    def poll_events(self) -> PublishedBatch | None:
        """The next numbered batch of what happened since the last one, or ``None`` when nothing did."""
        with self.books.lock:
            return self.books.events().poll()

    def replay_events(self, from_seq: int) -> list[PublishedBatch] | None:
        """Batches from ``from_seq`` on, or ``None`` when the replay buffer no longer reaches back that far."""
        with self.books.lock:
            pub = self.books.events()
        return pub.replay(from_seq)

    def event_snapshot(self) -> tuple[PublishedBatch | None, Snapshot]:
        """Every block held now (for a router that starts late or fell behind), and the batch it flushed."""
        with self.books.lock:
            return self.books.events().snapshot()

    def start_publishing(self, sink: Callable[[PublishedBatch], object], interval_s: float = 0.005,
                         owner: str = "") -> bool:
        return self.pusher.start(sink, interval_s, owner)

    def stop_publishing(self) -> None:
        self.pusher.stop()

    # ------------------------------------------------------------------ migration endpoints

    def export_begin(self, tokens: Sequence[int], max_blocks: int | None = None, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ExportTicket:
        return self.transfers.export_begin(tokens, max_blocks, lora_id, cache_salt)

    def send_prefix(self, tokens: Sequence[int], dst_rank: int, max_blocks: int | None = None,
                    lora_id: int | None = None, cache_salt: str | None = None, tag: int = 0) -> PrefixMoved:
        return self.transfers.send_prefix(tokens, dst_rank, max_blocks, lora_id, cache_salt, tag)

    def receive_prefix(self, tokens: Sequence[int], src_rank: int, max_blocks: int | None = None,
                       lora_id: int | None = None, cache_salt: str | None = None, tag: int = 0) -> PrefixMoved:
        return self.transfers.receive_prefix(tokens, src_rank, max_blocks, lora_id, cache_salt, tag)

    def in_transfer(self, tag: int) -> bool:
        return self.transfers.in_transfer(tag)

    def export_read(self, pin_id: int, start: int) -> list[torch.Tensor]:
        return self.transfers.export_read(pin_id, start)

    def export_end(self, pin_id: int) -> None:
        self.transfers.export_end(pin_id)

    def import_begin(self, tokens: Sequence[int], num_blocks: int, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ImportTicket:
        return self.transfers.import_begin(tokens, num_blocks, lora_id, cache_salt)

    def import_write(self, import_id: int, data: Sequence[torch.Tensor]) -> int:
        return self.transfers.import_write(import_id, data)

    def import_commit(self, import_id: int) -> int:
        return self.transfers.import_commit(import_id)

    def import_abort(self, import_id: int) -> None:
        self.transfers.import_abort(import_id)
