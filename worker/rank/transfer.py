"""A rank's two ends of a KV migration: pin and send blocks it holds, allocate and receive blocks it lacks.

The choreography between two ranks is written once, in
``kvledger.coordinator.migration``; these are the steps it calls on each side.
The ledger is touched only under the rank's lock, while the bytes move outside
it, into blocks the ledger holds for the transfer: pinned on the source, a
running import sequence on the target. So a rank blocked in a ``recv`` still
serves, probes and reports. A failed or aborted import never stores a block
whose KV was not written.

Bytes move one of three ways: over the process group (``export_send`` /
``import_recv``, one contiguous message), in this process (``export_read`` /
``import_write``, a tensor handed over), or not at all for ledgers that keep
only the books (``import_commit``, the replay simulator's metadata path).
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kvledger.worker.ledger.kv_pool import copy_blocks
from kvledger.worker.rank.books import RankBooks
from kvledger.worker.wire.messages import ExportTicket, ImportTicket
from kvledger.worker.wire.request import Request

#: Ids the rank gives its own pins and imports: far below any id a caller would pick.
_INTERNAL_IDS = itertools.count(-(2 ** 62))


def contiguous_view(pool: torch.Tensor, slots: list[int]) -> torch.Tensor | None:
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
class TransferCounts:
    """How migrations moved their bytes (straight from or into the pool, or through the staging buffer)."""

    sent_direct: int = 0
    sent_gathered: int = 0
    gather_copies: int = 0
    received_direct: int = 0
    received_scattered: int = 0
    scatter_copies: int = 0


class TransferEndpoints:
    """The source and target steps of migrations on one rank's ledger (see the module docstring)."""

    def __init__(self, books: RankBooks) -> None:
        self.books = books
        self.counts = TransferCounts()
        self._held: dict[int, list[int]] = {}   # pin or import id -> pool slots still to be sent or written
        self._send_staging, self._recv_staging = _Staging(), _Staging()

    # ------------------------------------------------------------------ source side

    def export_begin(self, tokens: Sequence[int], max_blocks: int | None = None, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ExportTicket:
        """Pin the stored full blocks matching ``tokens`` (host-tier ones are onboarded first)."""
        pin_id = next(_INTERNAL_IDS)
        with self.books.lock:
            slots = self.books.ledger().pin_prefix(pin_id, tokens, lora_id=lora_id, cache_salt=cache_salt,
                                                   max_blocks=max_blocks)
            self._held[pin_id] = slots
        return ExportTicket(pin_id, len(slots))

    def export_send(self, pin_id: int, start: int, dst_rank: int) -> int:
        """Send pinned blocks ``start..`` to ``dst_rank`` as one contiguous message, then unpin; returns bytes.

        Straight from the pool when the blocks are one run of slots, else gathered
        into the staging buffer (one slice copy per run of slots).
        """
        kept = False
        try:
            with self.books.lock:
                slots = self._held[pin_id][start:]
                pool = self.books.ledger().pools.primary
                buf = contiguous_view(pool, slots)
                if buf is None and slots:
                    buf, kept = self._send_staging.take(len(slots), pool)
                    self.counts.gather_copies += copy_blocks(pool, buf, [(s, i) for i, s in enumerate(slots)])
                    self.counts.sent_gathered += 1
                elif slots:
                    self.counts.sent_direct += 1
            if buf is not None:
                dist.send(buf, dst=dst_rank)
            return 0 if buf is None else buf.numel() * buf.element_size()
        finally:
            self._send_staging.give_back(kept)
            self.export_end(pin_id)

    def export_read(self, pin_id: int, start: int) -> torch.Tensor | None:
        """In-process path: pinned blocks ``start..`` gathered into one tensor (``None`` if none), then unpinned."""
        try:
            with self.books.lock:
                slots = self._held[pin_id][start:]
                return self.books.ledger().pools.read_blocks(slots) if slots else None
        finally:
            self.export_end(pin_id)

    def export_end(self, pin_id: int) -> None:
        """Release a pin (idempotent: a send that already released it is fine)."""
        with self.books.lock:
            if self._held.pop(pin_id, None) is not None:
                self.books.ledger().unpin_sequence(pin_id)

    # ------------------------------------------------------------------ target side

    def import_begin(self, tokens: Sequence[int], num_blocks: int, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ImportTicket:
        """Allocate destination blocks for the first ``num_blocks`` full blocks of ``tokens``.

        Admits an internal request of those blocks' tokens plus one more (the
        ledger never reuses a prompt's last token), so blocks this rank already
        holds are shared, not received again. With nothing to receive the import
        is already finished.
        """
        T = self.books.template.tokens_per_block
        if not isinstance(num_blocks, int) or num_blocks < 1 or len(tokens) <= num_blocks * T:
            raise ValueError(f"import_begin: need 1 <= num_blocks and more than num_blocks*{T} tokens, "
                             f"got num_blocks={num_blocks!r} for {len(tokens)} tokens")
        rid = next(_INTERNAL_IDS)
        req = Request(request_id=rid, tokens=list(tokens[:num_blocks * T + 1]), lora_id=lora_id,
                      cache_salt=cache_salt)
        with self.books.lock:
            mgr = self.books.ledger()
            mgr.add_sequence(req)
            first_new = mgr.admission(rid).reused_blocks
            if first_new >= num_blocks:
                mgr.remove_sequence(rid)
                return ImportTicket(rid, 0)
            slots = [mgr.blocks[b].slot for b in mgr.get_block_ids(rid)[first_new:num_blocks]]
            self._held[rid] = slots
            return ImportTicket(rid, len(slots))

    def import_recv(self, import_id: int, src_rank: int) -> int:
        """Receive the blocks from ``src_rank`` in one message and store them; returns blocks stored.

        Straight into the pool when the destination slots are one run, else into
        the staging buffer and scattered from there. The stored blocks are
        reusable and announced (``BlockStored``). On any failure the import is
        aborted: nothing unwritten is ever stored.
        """
        with self.books.lock:
            slots = self._slots_of(import_id)
            pool = self.books.ledger().pools.primary
            direct = contiguous_view(pool, slots)
            buf, kept = (direct, False) if direct is not None else self._recv_staging.take(len(slots), pool)
        try:
            try:
                dist.recv(buf, src=src_rank)
            except BaseException:
                self.import_abort(import_id)
                raise
            with self.books.lock:
                if direct is None:  # scatter
                    self.counts.scatter_copies += copy_blocks(buf, pool, [(i, s) for i, s in enumerate(slots)])
                    self.counts.received_scattered += 1
                else:
                    self.counts.received_direct += 1
                self._store(import_id)
        finally:
            self._recv_staging.give_back(kept)
        return len(slots)

    def import_write(self, import_id: int, data: torch.Tensor | None) -> int:
        """In-process path: scatter ``data`` (from ``export_read``) into the import's blocks and store them.

        A buffer of the wrong shape aborts the import (nothing is stored) and raises ``ValueError``.
        """
        with self.books.lock:
            slots = self._slots_of(import_id)
            mgr = self.books.ledger()
            want = (len(slots), *self.books.template.block_shape)
            if data is None or tuple(data.shape) != want:
                self._abort(import_id)
                got = None if data is None else tuple(data.shape)
                raise ValueError(f"import {import_id}: got a buffer of shape {got}, expected {want}")
            mgr.pools.write_blocks(slots, data.to(device=mgr.pools.primary.device, dtype=self.books.template.dtype))
            self._store(import_id)
        return len(slots)

    def import_commit(self, import_id: int) -> int:
        """Books-only path: store the import's blocks with no data to write (a ledger without tensors only)."""
        with self.books.lock:
            slots = self._slots_of(import_id)
            if self.books.ledger().pools.primary is not None:
                self._abort(import_id)
                raise ValueError(f"import {import_id}: this ledger keeps KV tensors; committing without data "
                                 "would store blocks whose KV was never written")
            self._store(import_id)
        return len(slots)

    def _slots_of(self, import_id: int) -> list[int]:
        """The slots import ``import_id`` still has to write (the caller holds the lock)."""
        slots = self._held.get(import_id)
        if slots is None:
            raise KeyError(f"no import {import_id} in progress on rank {self.books.rank}")
        return slots

    def import_abort(self, import_id: int) -> None:
        """Give the import's blocks back without storing any (idempotent)."""
        with self.books.lock:
            self._abort(import_id)

    def _abort(self, import_id: int) -> None:
        if self._held.pop(import_id, None) is not None:
            self.books.ledger().remove_sequence(import_id, store=False)

    def _store(self, import_id: int) -> None:
        """The import's KV is written: its blocks become reusable and announced, and the import ends."""
        del self._held[import_id]
        mgr = self.books.ledger()
        mgr.store_context_blocks(import_id)
        mgr.remove_sequence(import_id)
