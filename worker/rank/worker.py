"""One rank: a ledger and the reference engine behind a lock, its side of the process group and of migrations.

``RankWorker`` is a plain class (unit-testable without Ray); ``RankActor`` at the
bottom is the thin ``@ray.remote`` wrapper the coordinator spawns. The actor is
threaded (``max_concurrency``), so a rank blocked in a ``recv`` still serves,
probes and reports: every ledger operation takes ``self._lock``, while the
bytes of a migration move outside it, into blocks the ledger holds for the
transfer (pinned on the source, a running import sequence on the target).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from kvledger.worker.device import dist_backend, resolve_device
from kvledger.worker.engine.reference import ReferenceEngine, ServeResult
from kvledger.worker.engine.tokenizer import encode
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.kv_pool import copy_blocks
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.wire.request import Request
from kvledger.worker.rank.publisher import EventPublisher
from kvledger.worker.wire.batches import PublishedBatch, Snapshot, StoredBlock
from kvledger.worker.wire.errors import RankNotReadyError

logger = logging.getLogger(__name__)

LogitsFormat = Literal["tensor", "list", "none"]
#: Ids the rank gives its own pins and imports: far below any id a caller would pick.
_INTERNAL_IDS = itertools.count(-(2 ** 62))


def request_from_dict(d: dict | Request) -> Request:
    """A ``Request`` from a plain dict: ``request_id``, ``tokens`` (or ``prompt`` text), ``max_new_tokens``, ..."""
    if isinstance(d, Request):
        return d
    if not isinstance(d, dict):
        raise TypeError(f"a request is a Request or a dict, got {type(d).__name__}")
    unknown = set(d) - {"request_id", "tokens", "prompt", "max_new_tokens", "lora_id", "cache_salt"}
    if unknown:
        raise ValueError(f"request dict has unknown keys {sorted(unknown)}")
    if ("tokens" in d) == ("prompt" in d):
        raise ValueError("a request dict needs exactly one of 'tokens' (ids) or 'prompt' (text)")
    if "request_id" not in d:
        raise ValueError("a request dict needs a 'request_id'")
    tokens = list(d["tokens"]) if "tokens" in d else encode(d["prompt"])
    return Request(request_id=d["request_id"], tokens=tokens, max_new_tokens=d.get("max_new_tokens", 0),
                   lora_id=d.get("lora_id"), cache_salt=d.get("cache_salt"))


def result_to_dict(res: ServeResult, rank: int, logits: LogitsFormat) -> dict:
    out = {"request_id": res.request_id, "rank": rank, "output_tokens": list(res.output_tokens),
           "cached_tokens": res.cached_tokens, "computed_tokens": res.computed_tokens,
           "onboarded_blocks": res.onboarded_blocks}
    if logits == "tensor":
        out["last_logits"] = res.last_logits
    elif logits == "list":
        out["last_logits"] = res.last_logits.tolist()
    return out


def _contiguous_view(pool: torch.Tensor, slots: list[int]) -> torch.Tensor | None:
    """The pool's slice holding ``slots`` when they are one ascending run (no copy needed), else ``None``.

    The pool is block-major, so such a slice is one contiguous buffer a send can
    read from, or a receive write into, directly.
    """
    if not slots or slots != list(range(slots[0], slots[0] + len(slots))):
        return None
    return pool[slots[0]:slots[0] + len(slots)]


class _Staging:
    """A contiguous buffer for one migration's blocks, kept between transfers.

    Fresh memory costs a page fault per page on first touch (about 25 ms for 64
    MiB on this CPU, as long as the gloo transfer itself), so the buffer a rank
    gathers into or receives into is reused; it grows to the largest transfer
    seen. One transfer holds it at a time; a concurrent one (with another peer)
    gets a fresh buffer instead of waiting.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._lock = threading.Lock()

    def take(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A ``[n, *block]`` buffer with ``like``'s block shape, dtype and device; and whether it is the kept one."""
        shape = (n, *like.shape[1:])
        if not self._lock.acquire(blocking=False):
            return torch.empty(shape, dtype=like.dtype, device=like.device), False
        b = self._buf
        if b is None or b.shape[0] < n or b.shape[1:] != like.shape[1:] or b.dtype != like.dtype \
                or b.device != like.device:
            self._buf = b = torch.empty(shape, dtype=like.dtype, device=like.device)
        return b[:n], True

    def give_back(self, kept: bool) -> None:
        if kept:
            self._lock.release()


@dataclasses.dataclass(slots=True)
class _Import:
    request_id: int
    slots: list[int]
    """Pool slots still to be written from the source rank, in prompt order."""


class RankWorker:
    """One rank's ledger and engine, its budget, its process-group membership and its migration endpoints."""

    def __init__(self, rank: int, world_size: int, cache: CacheConfig, seed: int = 0,
                 gpu_memory_fraction: float = 0.5, replay_size: int = 1024) -> None:
        if not isinstance(rank, int) or not isinstance(world_size, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in 0..world_size-1, got rank={rank!r} world_size={world_size!r}")
        if not 0.0 < gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction!r}")
        self.rank, self.world_size = rank, world_size
        self.template = cache
        self.device = resolve_device(cache.device)
        self.seed = seed
        self.gpu_memory_fraction = gpu_memory_fraction
        self.manager: KVCacheManager | None = None
        self._local_counts: tuple[int, int] | None = None
        self.publisher: EventPublisher | None = None
        self.replay_size = replay_size
        self._push_thread: threading.Thread | None = None
        self._push_stop = threading.Event()
        self._push_owner: str | None = None
        self.engine = ReferenceEngine(cache, seed=seed)
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._store: dist.TCPStore | None = None
        self._imports: dict[int, _Import] = {}
        self._queued_tokens = self._queued_requests = self._running = 0
        self._served = 0
        self._scratch_buf: torch.Tensor | None = None
        self._send_staging, self._recv_staging = _Staging(), _Staging()
        self._transfers = {"sent_direct": 0, "sent_gathered": 0, "gather_copies": 0,
                           "received_direct": 0, "received_scattered": 0, "scatter_copies": 0}

    # ------------------------------------------------------------------ budget and ledger

    def local_block_counts(self) -> tuple[int, int]:
        """Blocks that fit this rank's budget: (device tier, host tier).

        Device tier: the configured byte budget (``CacheConfig.primary_bytes`` or
        block count); on CUDA without a byte budget, ``gpu_memory_fraction`` of the
        free device memory, measured once, before this rank allocated its pools (a
        group re-formed later must not count the rank's own pool against it).
        Host tier: the configured budget.
        """
        if self._local_counts is None:
            bpb = self.template.bytes_per_block
            if self.device.type == "cuda" and self.template.primary_bytes is None:
                free, _total = torch.cuda.mem_get_info(self.device)
                primary = int(free * self.gpu_memory_fraction) // bpb
            else:
                primary = self.template.primary_blocks()
            self._local_counts = (primary, self.template.secondary_blocks())
        return self._local_counts

    def build_ledger(self, num_primary: int, num_secondary: int) -> tuple[int, int]:
        """Build (or keep, when the counts are unchanged) the ledger with these block counts."""
        with self._lock:
            if self.manager is not None and (self.manager.num_primary, self.manager.num_secondary) == (
                    num_primary, num_secondary):
                return num_primary, num_secondary
            cfg = dataclasses.replace(self.template, num_primary_blocks=num_primary,
                                      num_secondary_blocks=num_secondary, primary_bytes=None, secondary_bytes=None)
            self.manager = KVCacheManager(cfg)
            self.publisher = EventPublisher(self.manager, self.rank, self.replay_size)
            logger.info("rank %d: ledger of %d device + %d host blocks on %s", self.rank, num_primary,
                        num_secondary, self.device)
            return num_primary, num_secondary

    def _mgr(self) -> KVCacheManager:
        if self.manager is None:
            raise RankNotReadyError(f"rank {self.rank}: the ledger is not built yet (block counts not agreed)")
        return self.manager

    def _pub(self) -> EventPublisher:
        self._mgr()
        assert self.publisher is not None, "a built ledger has a publisher"
        return self.publisher

    # ------------------------------------------------------------------ process group

    def open_store(self, host: str, timeout_s: float) -> int:
        """Rank 0: open the rendezvous store on an OS-chosen free port; returns the port."""
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 opens the store, this is rank {self.rank}")
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return self._store.port

    def join_group(self, host: str, port: int, timeout_s: float, generation: int = 0) -> str:
        """Join the process group at ``host:port`` (leaving any earlier one); returns the backend."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's sockets on loopback
        timeout = timedelta(seconds=timeout_s)
        if self.rank != 0:
            self._store = dist.TCPStore(host, port, self.world_size, is_master=False, timeout=timeout)
        assert self._store is not None, "rank 0 joins after open_store"
        backend = dist_backend(self.device)
        store = dist.PrefixStore(f"g{generation}", self._store)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        return backend

    def leave_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

    def agree_block_counts(self) -> tuple[int, int]:
        """All-reduce MIN of this rank's block counts over the group, then build the ledger with the result."""
        mine = self.local_block_counts()
        dev = self.device if dist_backend(self.device) == "nccl" else torch.device("cpu")
        t = torch.tensor(mine, dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        agreed = (int(t[0]), int(t[1]))
        if agreed[0] <= 0:
            raise RuntimeError(f"the agreed device-tier block count is {agreed[0]}: some rank has no budget")
        return self.build_ledger(*agreed)

    # ------------------------------------------------------------------ serving

    def serve(self, requests: Sequence[dict | Request], logits: LogitsFormat = "tensor") -> list[dict]:
        """Serve a batch through the engine; plain results (see ``result_to_dict``)."""
        return self._serve(requests, logits, publish=False)[0]

    def serve_published(self, requests: Sequence[dict | Request],
                        logits: LogitsFormat = "none") -> tuple[list[dict], PublishedBatch | None]:
        """``serve``, then publish the events it caused as the next numbered batch, before the ledger is
        released (so a router learns them with the results, without waiting behind the next batch served)."""
        return self._serve(requests, logits, publish=True)

    def _serve(self, requests: Sequence[dict | Request], logits: LogitsFormat,
               publish: bool) -> tuple[list[dict], PublishedBatch | None]:
        reqs = [request_from_dict(r) for r in requests]
        tokens = sum(len(r.tokens) for r in reqs)
        with self._count_lock:  # queued until the ledger is ours
            self._queued_tokens += tokens
            self._queued_requests += len(reqs)
        with self._lock:
            with self._count_lock:
                self._queued_tokens -= tokens
                self._queued_requests -= len(reqs)
                self._running = len(reqs)
            try:
                results = self.engine.serve(self._mgr(), reqs)
            finally:
                with self._count_lock:
                    self._running = 0
            self._served += len(results)
            batch = self._pub().poll() if publish else None
        return [result_to_dict(r, self.rank, logits) for r in results], batch

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> int:
        """Exact probe: tokens of ``tokens[:-1]`` this rank holds as full blocks (either tier)."""
        with self._lock:
            return self._mgr().probe_prefix_match_length(tokens, lora_id=lora_id, cache_salt=cache_salt)

    def load(self) -> dict:
        """Queued prefill tokens, running requests, blocks used/free per tier."""
        with self._lock:
            s = self.manager.stats() if self.manager is not None else None
        publishing = self._push_thread is not None and self._push_thread.is_alive()
        with self._count_lock:
            out = {"rank": self.rank, "publishing": publishing, "queued_prefill_tokens": self._queued_tokens,
                   "queued_requests": self._queued_requests, "running_requests": self._running,
                   "served_requests": self._served}
        if s is None:
            return {**out, "ready": False}
        return {**out, "ready": True,
                "device_blocks_used": s.used_num_blocks, "device_blocks_free": s.free_num_blocks,
                "host_blocks_used": s.max_num_secondary_blocks - s.num_free_secondary_blocks,
                "host_blocks_free": s.num_free_secondary_blocks}

    def stats(self) -> dict:
        """The ledger's ``KvCacheStats`` as a dict, plus where this rank lives."""
        with self._lock:
            s = dataclasses.asdict(self._mgr().stats())
            transfers = dict(self._transfers)
        return {**s, "rank": self.rank, "device": str(self.device), "backend": dist_backend(self.device),
                "in_group": dist.is_initialized(), "transfers": transfers}

    # ------------------------------------------------------------------ events for routers

    def poll_events(self) -> PublishedBatch | None:
        """The next numbered batch of what happened since the last one, or ``None`` when nothing did."""
        with self._lock:
            return self._pub().poll()

    def replay_events(self, from_seq: int) -> list[PublishedBatch] | None:
        """Batches from ``from_seq`` on, or ``None`` when the replay buffer no longer reaches back that far."""
        with self._lock:
            pub = self._pub()
        return pub.replay(from_seq)

    def event_snapshot(self) -> tuple[PublishedBatch | None, Snapshot]:
        """Every block held now (for a router that starts late or fell behind), and the batch it flushed."""
        with self._lock:
            return self._pub().snapshot()

    def start_publishing(self, sink: Callable[[PublishedBatch], object], interval_s: float = 0.005,
                         owner: str = "") -> bool:
        """Push every new batch to ``sink`` from a background thread, checking every ``interval_s``.

        Returns ``False`` when ``owner`` is already being pushed to; another owner
        replaces the current one. A sink that raises is logged and pushing goes on
        (the receiver closes the gap with a replay).
        """
        if not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"start_publishing: interval_s must be > 0, got {interval_s!r}")
        if self._push_thread is not None and self._push_thread.is_alive():
            if self._push_owner == owner:
                return False
            self.stop_publishing()
        stop = threading.Event()
        self._push_stop, self._push_owner = stop, owner

        def push() -> None:
            while not stop.wait(interval_s):
                with self._lock:
                    batch = self.publisher.poll() if self.publisher is not None else None
                if batch is None:
                    continue
                try:
                    sink(batch)
                except Exception as e:  # the receiver notices the gap and asks for a replay
                    logger.warning("rank %d: pushing batch %d failed: %s", self.rank, batch.seq, e)

        self._push_thread = threading.Thread(target=push, name=f"rank{self.rank}-publisher", daemon=True)
        self._push_thread.start()
        return True

    def stop_publishing(self) -> None:
        thread, self._push_thread = self._push_thread, None
        self._push_stop.set()
        self._push_owner = None
        if thread is not None:
            thread.join(timeout=10)

    def snapshot(self) -> list[StoredBlock]:
        with self._lock:
            return self._mgr().snapshot()

    def check_integrity(self) -> None:
        with self._lock:
            self._mgr().check_integrity()

    # ------------------------------------------------------------------ migration: source side

    def export_begin(self, tokens: Sequence[int], max_blocks: int | None = None, lora_id: int | None = None,
                     cache_salt: str | None = None) -> tuple[int, int]:
        """Pin the stored full blocks matching ``tokens``; returns (pin id, number of blocks pinned)."""
        pin_id = next(_INTERNAL_IDS)
        with self._lock:
            slots = self._mgr().pin_prefix(pin_id, tokens, lora_id=lora_id, cache_salt=cache_salt,
                                           max_blocks=max_blocks)
            self._imports[pin_id] = _Import(pin_id, slots)
        return pin_id, len(slots)

    def export_send(self, pin_id: int, start: int, dst_rank: int) -> int:
        """Send pinned blocks ``start..`` to ``dst_rank`` as one contiguous message, then unpin; returns bytes.

        Straight from the pool when the blocks are one run of slots, else gathered
        into the rank's staging buffer (one slice copy per run of slots).
        """
        kept = False
        try:
            with self._lock:
                slots = self._imports[pin_id].slots[start:]
                pool = self._mgr().pools.primary
                buf = _contiguous_view(pool, slots)
                if buf is None and slots:
                    buf, kept = self._send_staging.take(len(slots), pool)
                    n = copy_blocks(pool, buf, [(s, i) for i, s in enumerate(slots)])
                    self._transfers["sent_gathered"] += 1
                    self._transfers["gather_copies"] += n
                elif slots:
                    self._transfers["sent_direct"] += 1
            if buf is not None:
                dist.send(buf, dst=dst_rank)
            return 0 if buf is None else buf.numel() * buf.element_size()
        finally:
            self._send_staging.give_back(kept)
            self.export_end(pin_id)

    def export_read(self, pin_id: int, start: int) -> torch.Tensor | None:
        """In-process path: pinned blocks ``start..`` gathered into one tensor (``None`` if none), then unpinned."""
        try:
            with self._lock:
                slots = self._imports[pin_id].slots[start:]
                return self._mgr().pools.read_blocks(slots) if slots else None
        finally:
            self.export_end(pin_id)

    def export_end(self, pin_id: int) -> None:
        """Release a pin (idempotent: a send that already released it is fine)."""
        with self._lock:
            if self._imports.pop(pin_id, None) is not None:
                self._mgr().unpin_sequence(pin_id)

    # ------------------------------------------------------------------ migration: target side

    def import_begin(self, tokens: Sequence[int], num_blocks: int, lora_id: int | None = None,
                     cache_salt: str | None = None) -> tuple[int, int]:
        """Allocate destination blocks for the first ``num_blocks`` full blocks of ``tokens``.

        Admits an internal request of those blocks' tokens plus one more (the
        ledger never reuses a prompt's last token), so blocks this rank already
        holds are shared, not received again. Returns (import id, blocks to
        receive); with nothing to receive the import is already finished.
        """
        T = self.template.tokens_per_block
        if not isinstance(num_blocks, int) or num_blocks < 1 or len(tokens) <= num_blocks * T:
            raise ValueError(f"import_begin: need 1 <= num_blocks and more than num_blocks*{T} tokens, "
                             f"got num_blocks={num_blocks!r} for {len(tokens)} tokens")
        rid = next(_INTERNAL_IDS)
        req = Request(request_id=rid, tokens=list(tokens[:num_blocks * T + 1]), lora_id=lora_id,
                      cache_salt=cache_salt)
        with self._lock:
            mgr = self._mgr()
            mgr.add_sequence(req)
            first_new = mgr.admission(rid).reused_blocks
            if first_new >= num_blocks:
                mgr.remove_sequence(rid)
                return rid, 0
            slots = [mgr.blocks[b].slot for b in mgr.get_block_ids(rid)[first_new:num_blocks]]
            self._imports[rid] = _Import(rid, slots)
            return rid, len(slots)

    def import_recv(self, import_id: int, src_rank: int) -> int:
        """Receive the blocks from ``src_rank`` in one message, store them; returns blocks stored.

        Straight into the pool when the destination slots are one run, else into
        the staging buffer and scattered from there. The stored blocks are
        reusable and announced (``BlockStored``). On any failure the import is
        aborted: nothing unwritten is ever stored.
        """
        with self._lock:
            imp = self._imports.get(import_id)
            mgr = self._mgr()
            if imp is None:
                raise KeyError(f"no import {import_id} in progress on rank {self.rank}")
            pool = mgr.pools.primary
            direct = _contiguous_view(pool, imp.slots)
            buf, kept = (direct, False) if direct is not None else self._recv_staging.take(len(imp.slots), pool)
        try:
            try:
                dist.recv(buf, src=src_rank)
            except BaseException:
                self.import_abort(import_id)
                raise
            with self._lock:
                del self._imports[import_id]
                if direct is None:  # scatter
                    pairs = [(i, s) for i, s in enumerate(imp.slots)]
                    self._transfers["scatter_copies"] += copy_blocks(buf, pool, pairs)
                self._transfers["received_direct" if direct is not None else "received_scattered"] += 1
                mgr.store_context_blocks(import_id)
                mgr.remove_sequence(import_id)
        finally:
            self._recv_staging.give_back(kept)
        return len(imp.slots)

    def import_write(self, import_id: int, data: torch.Tensor | None) -> int:
        """In-process path: scatter ``data`` (from ``export_read``) into the import's blocks and store them.

        A buffer of the wrong shape aborts the import (nothing is stored) and raises ``ValueError``.
        """
        with self._lock:
            imp = self._imports.pop(import_id, None)
            if imp is None:
                raise KeyError(f"no import {import_id} in progress on rank {self.rank}")
            mgr = self._mgr()
            want = (len(imp.slots), *self.template.block_shape)
            if data is None or tuple(data.shape) != want:
                mgr.remove_sequence(import_id, store=False)
                got = None if data is None else tuple(data.shape)
                raise ValueError(f"import {import_id}: got a buffer of shape {got}, expected {want}")
            mgr.pools.write_blocks(imp.slots, data.to(device=mgr.pools.primary.device, dtype=self.template.dtype))
            mgr.store_context_blocks(import_id)
            mgr.remove_sequence(import_id)
        return len(imp.slots)

    def import_abort(self, import_id: int) -> None:
        with self._lock:
            if self._imports.pop(import_id, None) is not None:
                self._mgr().remove_sequence(import_id, store=False)

    # ------------------------------------------------------------------ raw transfers (migration bench baseline)

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._scratch_buf
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._scratch_buf = torch.ones(numel, dtype=dtype, device=self.device)
        return buf

    def send_tensor(self, numel: int, dst_rank: int, dtype: torch.dtype = torch.float16) -> int:
        """Send one contiguous tensor (kept between calls, so only the first call allocates it)."""
        buf = self._scratch(numel, dtype)
        dist.send(buf, dst=dst_rank)
        return numel * buf.element_size()

    def recv_tensor(self, numel: int, src_rank: int, dtype: torch.dtype = torch.float16) -> int:
        """Receive one contiguous tensor into a buffer kept between calls."""
        buf = self._scratch(numel, dtype)
        dist.recv(buf, src=src_rank)
        return numel * buf.element_size()


def _make_actor_class():
    import ray

    @ray.remote(max_concurrency=8)
    class RankActor(RankWorker):
        """``RankWorker`` as a threaded Ray actor (options such as ``num_gpus`` come from the coordinator)."""

        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def pid(self) -> int:
            return os.getpid()

        def ping(self) -> int:
            return self.rank

        def attach_router(self, router: ray.actor.ActorHandle, interval_s: float = 0.005) -> bool:
            """Push this rank's event batches to ``router.ingest(rank, seq, data)``, fire-and-forget.

            At most ``_MAX_PUSHES_IN_FLIGHT`` pushes stay unanswered: past that the
            publisher thread waits for the router (back-pressure, so a slow router's
            queue of calls stays bounded), never longer than 30 s a time.
            """
            in_flight: list = []

            def sink(batch: PublishedBatch) -> None:
                in_flight.append(router.ingest.remote(self.rank, batch.seq, batch.data))
                if len(in_flight) > _MAX_PUSHES_IN_FLIGHT:
                    _, in_flight[:] = ray.wait(in_flight, num_returns=len(in_flight) // 2, timeout=30)

            return self.start_publishing(sink, interval_s, owner=router._actor_id.hex())

    return RankActor


_actor_class = None
#: Event pushes a rank leaves unanswered before its publisher waits for the router.
_MAX_PUSHES_IN_FLIGHT = 64


def rank_actor_class():
    """The ``@ray.remote`` wrapper of ``RankWorker`` (built on first use, so importing this module needs no Ray)."""
    global _actor_class
    if _actor_class is None:
        _actor_class = _make_actor_class()
    return _actor_class
