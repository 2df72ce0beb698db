"""The ledger one rank keeps, its event publisher, and the lock every call into them takes.

A rank's actor is threaded (a rank blocked in a ``recv`` must still serve and
report), so serving, probing, publishing and the migration endpoints all meet
here: whoever touches the ledger holds ``lock``. The ledger is built only once
the ranks agreed on its block counts; until then (and after a restart) every
call that needs it raises ``RankNotReadyError``.

A step may also run under the lock after its caller returned (``defer``): the
lock is taken at once and handed to the books thread, so a migration's target
returns while it stores what it received, and every later call waits for it.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.rank.faults import CrashPoints
from kvledger.worker.rank.publisher import EventPublisher
from kvledger.worker.wire.errors import RankNotReadyError

logger = logging.getLogger(__name__)


class RankBooks:
    """One rank's ledger (``manager``) and publisher, once built; see the module docstring."""

    def __init__(self, rank: int, template: CacheConfig, device: torch.device, gpu_memory_fraction: float,
                 replay_size: int, clock: Callable[[], float] | None = None) -> None:
        """``clock`` (default: the real ones) drives the ledger's retention and the batches' timestamps; the
        replay simulator passes its simulated time."""
        if not 0.0 < gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction!r}")
        self.rank = rank
        self.template = template
        self.device = device
        self.gpu_memory_fraction = gpu_memory_fraction
        self.replay_size = replay_size
        self.clock = clock
        self.lock = threading.Lock()
        self.manager: KVCacheManager | None = None
        self.publisher: EventPublisher | None = None
        self._local_counts: tuple[int, ...] | None = None
        self.faults = CrashPoints(rank)
        """Crashes armed on purpose (``RankWorker.arm_crash``); every part of the rank reports its points here."""
        self._deferred: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._books_thread: threading.Thread | None = None

    def defer(self, step: Callable[[], None]) -> None:
        """Run ``step`` under ``lock`` on the books thread, the lock taken here and now (waiting for it like any
        caller): the caller returns, and its reply travels, while ``step`` runs, and whoever touches the ledger
        next waits until ``step`` is done. A ``step`` that raises is logged (it runs after its caller returned)."""
        self.lock.acquire()
        try:
            if self._books_thread is None:
                self._books_thread = threading.Thread(target=self._run_deferred, name=f"rank-{self.rank}-books",
                                                      daemon=True)
                self._books_thread.start()
            self._deferred.put(step)
        except BaseException:
            self.lock.release()
            raise

    def _run_deferred(self) -> None:
        while True:
            step = self._deferred.get()
            try:
                step()
            except Exception:
                logger.exception("rank %d: a deferred ledger step failed", self.rank)
            finally:
                self.lock.release()

    def local_block_counts(self) -> tuple[int, ...]:
        """Blocks that fit this rank's budget: (device tier, host tier), and so on for every further attention window
        (``CacheConfig.window_layouts``): ``(device 0, host 0, device 1, host 1, ...)``, a flat tuple that the MIN
        all-reduce takes element-wise, so that every rank agrees on every window's counts.

        Device tier: the configured byte budget (``CacheConfig.primary_bytes`` or
        block count); on CUDA without a byte budget, ``gpu_memory_fraction`` of the
        free device memory, measured once, before this rank allocated its pools (a
        group re-formed later must not count the rank's own pool against it), split
        between the windows as ``window_shares`` says. Host tier: the configured budget.
        """
        if self._local_counts is None:
            cfg = self.template
            if self.device.type == "cuda" and cfg.primary_bytes is None:
                free, _total = torch.cuda.mem_get_info(self.device)
                cfg = dataclasses.replace(cfg, primary_bytes=int(free * self.gpu_memory_fraction), window_blocks=None)
            self._local_counts = tuple(n for pair in cfg.window_block_counts() for n in pair)
        return self._local_counts

    def build(self, num_primary: int, num_secondary: int, *more_windows: int) -> tuple[int, ...]:
        """Build (or keep, when the counts are unchanged) the ledger with these block counts: window 0's device and
        host tiers, then ``(device, host)`` of every further attention window, as ``local_block_counts`` orders them."""
        counts = (num_primary, num_secondary, *more_windows)
        windows = tuple(zip(counts[::2], counts[1::2]))
        if len(counts) != 2 * len(self.template.window_layouts):
            raise ValueError(f"rank {self.rank}: the ledger has {len(self.template.window_layouts)} attention windows; "
                             f"build takes a (device, host) pair for each, got {counts}")
        with self.lock:
            if self.manager is not None and self.manager.window_block_counts == windows:
                return counts
            cfg = dataclasses.replace(self.template, num_primary_blocks=num_primary,
                                      num_secondary_blocks=num_secondary, primary_bytes=None, secondary_bytes=None,
                                      window_blocks=windows if len(windows) > 1 else None)
            self.manager = KVCacheManager(cfg, clock=self.clock or time.monotonic)
            self.publisher = EventPublisher(self.manager, self.rank, self.replay_size, clock=self.clock or time.time,
                                            faults=self.faults)
            logger.info("rank %d: ledger of %s (device, host) blocks per attention window on %s", self.rank,
                        windows, self.device)
            return counts

    def ledger(self) -> KVCacheManager:
        """The built ledger (the caller holds ``lock``), or ``RankNotReadyError``."""
        if self.manager is None:
            raise RankNotReadyError(f"rank {self.rank}: the ledger is not built yet (block counts not agreed)")
        return self.manager

    def events(self) -> EventPublisher:
        """The built ledger's publisher, or ``RankNotReadyError``."""
        self.ledger()
        assert self.publisher is not None, "a built ledger has a publisher"
        return self.publisher
