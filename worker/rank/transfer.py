"""A rank's two ends of a KV migration: pin and send blocks it holds, allocate and receive blocks it lacks.

The steps (pin, allocate what the target lacks, move, store, release) are
written once; two choreographies call them. Between rank actors each side runs
a whole migration in one call (``send_prefix`` on the source, ``receive_prefix``
on the target, launched together), negotiating over the process group in two
messages: the source sends the slots of the blocks it pinned; the target
allocates the blocks it lacks, gives them slots that run along the source's,
posts their receives and answers how many it holds already and where the
others go. The source then sends, each piece at once (gloo sends a message as
soon as its receive is posted, else it waits for the receiver's notice), in the
pieces ``transfer_plan`` cuts alike on both sides, straight from one pool into
the other. The target stores what it received while its reply travels.
In-process ranks and ledgers that keep only the books are driven step by step
by ``kvledger.coordinator.migration`` (``export_begin``, ``export_read`` /
``import_write`` for a tensor handed over, or ``import_commit`` with no bytes
at all, ``export_end``, ``import_abort``).

The ledger is touched only under the rank's lock, while the bytes move outside
it, into blocks the ledger holds for the transfer: pinned on the source, a
running import sequence on the target. So a rank blocked in a ``recv`` still
serves, probes and reports. Whatever fails, each side undoes its own step (the
pin is released, the import aborted): no block whose KV was not written is
ever stored, nothing stays pinned, and a side that fails before its message
still sends one (saying there is nothing), so its peer is not left waiting.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from math import prod

import torch
import torch.distributed as dist

from kvledger.worker.ledger.kv_pool import copy_blocks
from kvledger.worker.rank.books import RankBooks
from kvledger.worker.rank.transfer_plan import aligned_slots, is_run, plan_pieces
from kvledger.worker.wire.messages import ExportTicket, ImportTicket
from kvledger.worker.wire.request import Request

logger = logging.getLogger(__name__)

#: Ids the rank gives its own pins and imports: far below any id a caller would pick.
_INTERNAL_IDS = itertools.count(-(2 ** 62))

#: Bytes of one piece whose copies a side overlaps with the next piece on the wire.
PIPELINE_BYTES = 8 << 20

#: Seconds a side still waits for each message it posted once another one failed.
ABANDON_S = 1.0


def contiguous_view(pool: torch.Tensor, slots: Sequence[int]) -> torch.Tensor | None:
    """The pool's slice holding ``slots`` when they are one ascending run (no copy needed), else ``None``.

    The pool is block-major, so such a slice is one contiguous buffer a send can
    read from, or a receive write into, directly.
    """
    if not slots or not is_run(slots):
        return None
    return pool[slots[0]:slots[0] + len(slots)]


def header_blocks(num_tokens: int, tokens_per_block: int, max_blocks: int | None) -> int:
    """The most blocks a source can pin for a prompt of ``num_tokens`` (the full blocks of all but its last
    token, at most ``max_blocks``): both sides size the negotiation's two messages by it."""
    full = max(0, (num_tokens - 1) // tokens_per_block)
    return full if max_blocks is None else min(full, max_blocks)


class _Staging:
    """A flat buffer a migration gathers into or receives into, kept between transfers.

    Fresh memory costs a page fault per page on first touch (about 25 ms for 64
    MiB on this CPU, as long as the gloo transfer itself), so the buffer is
    reused; it grows to the largest transfer seen. One transfer holds it at a
    time; a concurrent one (with another peer) gets a fresh buffer instead of
    waiting.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bool]:
        """A 1-D buffer of ``numel`` elements; and whether it is the kept one (to ``give_back``)."""
        if not self._lock.acquire(blocking=False):
            return torch.empty(numel, dtype=dtype, device=device), False
        b = self._buf
        if b is None or b.numel() < numel or b.dtype != dtype or b.device != device:
            self._buf = b = torch.empty(numel, dtype=dtype, device=device)
        return b[:numel], True

    def give_back(self, kept: bool) -> None:
        if kept:
            self._lock.release()


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixMoved:
    """One side's account of a migration it took part in (``send_prefix`` / ``receive_prefix``)."""

    matched_blocks: int
    """Full prefix blocks the source held (and pinned)."""
    moved_blocks: int
    """Blocks that crossed (the target already held the others)."""
    bytes: int
    seconds: float
    """This side's share of the move itself, once both sides were prepared."""


class _PieceBuffers:
    """Each piece's tensors on one side, one per pool: a pool slice where the piece's slots there are one run,
    else a slice of the staging buffer (``gather`` / ``scatter`` copy it from or to the pool)."""

    def __init__(self, pools: list[torch.Tensor], slot_lists: list[list[int]], staging: _Staging) -> None:
        self.pools = pools
        direct = [is_run(s) for s in slot_lists]
        n = sum(len(s) for s, d in zip(slot_lists, direct) if not d)
        per_block = [prod(p.shape[1:]) for p in pools]
        self.flat, self.kept = (staging.take(n * sum(per_block), pools[0].dtype, pools[0].device) if n
                                else (None, False))
        self._staging = staging
        self.regions: list[torch.Tensor] = []
        at = 0
        for pool, e in zip(pools, per_block):
            if self.flat is not None:
                self.regions.append(self.flat[at:at + n * e].view(n, *pool.shape[1:]))
            at += n * e
        self.views: list[list[torch.Tensor]] = []
        self.pairs: list[list[tuple[int, int]] | None] = []   # (pool slot, staging row) of a staged piece
        row = 0
        for slots, d in zip(slot_lists, direct):
            if d:
                self.views.append([contiguous_view(p, slots) for p in pools])
                self.pairs.append(None)
            else:
                self.views.append([r[row:row + len(slots)] for r in self.regions])
                self.pairs.append([(s, row + i) for i, s in enumerate(slots)])
                row += len(slots)

    def gather(self, i: int) -> int:
        """Copy piece ``i``'s blocks from the pools into its staging slices (if staged); returns slice copies."""
        pairs = self.pairs[i]
        return 0 if pairs is None else sum(copy_blocks(p, r, pairs) for p, r in zip(self.pools, self.regions))

    def scatter(self, i: int) -> int:
        """Copy piece ``i``'s staged blocks into the pools; returns slice copies."""
        pairs = self.pairs[i]
        if pairs is None:
            return 0
        back = [(r, s) for s, r in pairs]
        return sum(copy_blocks(r, p, back) for p, r in zip(self.pools, self.regions))

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for views in self.views for v in views)

    def release(self) -> None:
        self._staging.give_back(self.kept)


def _wait_all(works: list) -> None:
    """Wait for every posted send or receive; after one failed, give each of the others a moment only
    (``ABANDON_S``: once a pair's channel broke, what is still posted on it never completes, and gloo would
    hold it to the group's timeout), then re-raise the first failure."""
    first: BaseException | None = None
    for w in works:
        try:
            w.wait() if first is None else w.wait(timeout=timedelta(seconds=ABANDON_S))
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


@dataclasses.dataclass(slots=True)
class TransferCounts:
    """How migrations moved their bytes: straight from or into the pools (``*_direct``: no copy at all), or with
    some pieces through the staging buffer; the messages (pieces) and slice copies it took."""

    sent_direct: int = 0
    sent_gathered: int = 0
    gather_copies: int = 0
    sent_pieces: int = 0
    received_direct: int = 0
    received_scattered: int = 0
    scatter_copies: int = 0
    received_pieces: int = 0


def _message(count: int, slots: list[int], size: int, device: torch.device) -> torch.Tensor:
    """``[count, *slots]`` padded with -1 to ``size`` entries: one negotiation message."""
    return torch.tensor([count, *slots, *[-1] * (size - 1 - len(slots))], dtype=torch.int64, device=device)


def _cross(out: torch.Tensor, into: torch.Tensor, peer: int, tag: int) -> list:
    """Send ``out`` to ``peer`` while receiving ``into`` from it, both posted at once (so that neither side
    waits for the other's send first, which NCCL, running a pair's operations in order, would deadlock on);
    returns the (send, receive) works."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer, tag=tag),
                                   dist.P2POp(dist.irecv, into, peer, tag=tag)])


def _wait_quietly(works: list) -> None:
    """After a failure: give each message still posted a moment (``ABANDON_S``) to end, raising nothing."""
    for w in works:
        try:
            w.wait(timeout=timedelta(seconds=ABANDON_S))
        except Exception as e:
            logger.debug("a transfer's remaining message failed too: %s", e)


class TransferEndpoints:
    """The source and target steps of migrations on one rank's ledger (see the module docstring)."""

    def __init__(self, books: RankBooks) -> None:
        self.books = books
        self.counts = TransferCounts()
        self._held: dict[int, list[int]] = {}   # pin or import id -> pool slots still to be sent or written
        self._send_staging, self._recv_staging = _Staging(), _Staging()
        self._running: set[int] = set()   # tags of the migrations this rank is in now

    def in_transfer(self, tag: int) -> bool:
        """Whether this rank is still in migration ``tag`` (a restarted rank never is)."""
        return tag in self._running

    @contextmanager
    def _taking_part(self, tag: int) -> Iterator[None]:
        self._running.add(tag)
        try:
            yield
        finally:
            self._running.discard(tag)

    # ------------------------------------------------------------------ a whole migration per side

    def send_prefix(self, tokens: Sequence[int], dst_rank: int, max_blocks: int | None = None,
                    lora_id: int | None = None, cache_salt: str | None = None, tag: int = 0) -> PrefixMoved:
        """Source of a migration to ``dst_rank`` (which runs ``receive_prefix`` with the same arguments).

        Pins the prefix blocks of ``tokens`` this rank holds and sends their
        slots; the target answers how many of them it holds already and where
        the others go, its receives already posted, and the blocks past its own
        go in the pieces ``transfer_plan`` cuts; releases the pin whatever
        happens. ``tag`` names the migration's messages (gloo keeps migrations
        with different tags apart, so two coordinators moving blocks between the
        same ranks do not take each other's messages).
        """
        with self._taking_part(tag):
            return self._send_prefix(tokens, dst_rank, max_blocks, lora_id, cache_salt, tag)

    def _send_prefix(self, tokens: Sequence[int], dst_rank: int, max_blocks: int | None, lora_id: int | None,
                     cache_salt: str | None, tag: int) -> PrefixMoved:
        size = 1 + header_blocks(len(tokens), self.books.template.tokens_per_block, max_blocks)
        ctl = self._control_device()
        try:
            pools = self._pools()
            ticket = self.export_begin(tokens, max_blocks, lora_id, cache_salt)
        except BaseException:
            self._refuse(size, dst_rank, tag)
            raise
        try:
            slots = self._held[ticket.pin_id]
            assert len(slots) < size, f"pinned {len(slots)} blocks of a prompt with {size - 1} full blocks"
            header = _message(len(slots), slots, size, ctl)
            if not slots:   # the target asks nothing of a source that holds nothing
                _wait_all([dist.isend(header, dst=dst_rank, tag=tag)])
                return PrefixMoved(0, 0, 0, 0.0)
            reply = torch.empty(size, dtype=torch.int64, device=ctl)
            sent, got = _cross(header, reply, dst_rank, tag)
            works = [sent]
            got.wait()
            start = min(int(reply[0]), len(slots))
            if start < 0 or start == len(slots):   # the target failed (it reports why), or holds them all
                _wait_all(works)
                return PrefixMoved(len(slots), 0, 0, 0.0)
            dst = reply[1:1 + len(slots) - start].tolist()
            self.books.faults.reached("migration_source")
            t0 = time.perf_counter()
            nbytes = self._send_pieces(pools, slots[start:], dst, dst_rank, tag, works)
            return PrefixMoved(len(slots), len(slots) - start, nbytes, time.perf_counter() - t0)
        finally:
            self.export_end(ticket.pin_id)

    def receive_prefix(self, tokens: Sequence[int], src_rank: int, max_blocks: int | None = None,
                       lora_id: int | None = None, cache_salt: str | None = None, tag: int = 0) -> PrefixMoved:
        """Target of a migration from ``src_rank`` (which runs ``send_prefix`` with the same arguments).

        Learns the source's pinned slots, allocates the blocks it lacks
        (sharing the prefix it holds), gives them slots that run along the
        source's, posts their receives and only then answers where they go (so
        every piece leaves the source at once), receives them and stores them
        (reusable, announced with ``BlockStored``) while its reply travels: the
        books' lock is taken before it returns, so no later call sees the books
        before the store. On any failure the import is aborted: nothing unwritten
        is ever stored.
        """
        with self._taking_part(tag):
            return self._receive_prefix(tokens, src_rank, max_blocks, lora_id, cache_salt, tag)

    def _receive_prefix(self, tokens: Sequence[int], src_rank: int, max_blocks: int | None, lora_id: int | None,
                        cache_salt: str | None, tag: int) -> PrefixMoved:
        size = 1 + header_blocks(len(tokens), self.books.template.tokens_per_block, max_blocks)
        ctl = self._control_device()
        header = torch.empty(size, dtype=torch.int64, device=ctl)
        _wait_all([dist.irecv(header, src=src_rank, tag=tag)])
        n = int(header[0])
        if n <= 0:   # nothing to receive; or the source failed (it reports why)
            return PrefixMoved(max(n, 0), 0, 0, 0.0)
        src_slots = header[1:1 + n].tolist()
        try:   # until the answer goes, a failure answers -1, so that the source is not left waiting for it
            pools = self._pools()
            ticket = self.import_begin(tokens, n, lora_id, cache_salt)
        except BaseException:
            self._refuse(size, src_rank, tag)
            raise
        start = n - ticket.blocks
        if not ticket.blocks:   # it holds them all (the import is over already)
            _wait_all([dist.isend(_message(n, [], size, ctl), dst=src_rank, tag=tag)])
            return PrefixMoved(n, 0, 0, 0.0)
        try:
            slots = self._align(ticket.import_id, start, src_slots[start:])
            self.books.faults.reached("migration_target")
        except BaseException:
            self.import_abort(ticket.import_id)
            self._refuse(size, src_rank, tag)
            raise
        try:
            t0 = time.perf_counter()
            nbytes = self._receive_pieces(pools, src_slots[start:], slots, src_rank, tag,
                                          _message(start, slots, size, ctl))
            self.books.defer(lambda: self._store(ticket.import_id))
            return PrefixMoved(n, n - start, nbytes, time.perf_counter() - t0)
        except BaseException:
            self.import_abort(ticket.import_id)
            raise

    def _align(self, import_id: int, first: int, src: list[int]) -> list[int]:
        """Give the import's fresh blocks (positions ``first..``, receiving from source slots ``src``) the slots
        ``aligned_slots`` picks among their own, so that the target receives straight into its pool wherever both
        sides' slots run; returns them. Only the import holds these blocks and none holds KV yet, so exchanging
        their slots (as an offload exchanges two blocks' slots) changes nothing anyone else sees."""
        with self.books.lock:
            slots = aligned_slots(src, self._held[import_id])
            self.books.ledger().arrange_slots(import_id, first, slots)
            self._held[import_id] = slots
            return slots

    def _pools(self) -> list[torch.Tensor]:
        with self.books.lock:
            pools = self.books.ledger().pools.primary_pools
        if not pools:
            raise ValueError(f"rank {self.books.rank} keeps no KV tensors: there are no bytes to send or receive")
        return pools

    def _send_pieces(self, pools: list[torch.Tensor], src: list[int], dst: list[int], dst_rank: int, tag: int,
                     works: list) -> int:
        """Post every piece's sends (gathering a piece that is not one run just before its send, while earlier
        ones are on the wire), then wait for all, ``works`` posted before too; returns the bytes sent."""
        pieces = self._plan(src, dst, pools)
        bufs = _PieceBuffers(pools, [[src[i] for i in p] for p in pieces], self._send_staging)
        try:
            copies = 0
            for i in range(len(pieces)):
                copies += bufs.gather(i)
                works.extend(dist.isend(v, dst=dst_rank, tag=tag) for v in bufs.views[i])
            _wait_all(works[::-1])   # a pair's messages complete in order: the last one's wait covers the rest
            self._count(copies, len(pieces), sent=True)
            return bufs.nbytes
        except BaseException:
            _wait_quietly(works)
            raise
        finally:
            bufs.release()

    def _receive_pieces(self, pools: list[torch.Tensor], src: list[int], dst: list[int], src_rank: int, tag: int,
                        go: torch.Tensor) -> int:
        """Receive the blocks from source slots ``src`` into target slots ``dst``, in the pieces both sides cut
        alike: post every receive, then send ``go`` (the answer the source waits for, in the same batch: NCCL
        runs a pair's operations in order), then wait, scattering each staged piece while later ones arrive;
        returns the bytes received."""
        pieces = self._plan(src, dst, pools)
        bufs = _PieceBuffers(pools, [[dst[i] for i in p] for p in pieces], self._recv_staging)
        ops = [dist.P2POp(dist.irecv, v, src_rank, tag=tag) for views in bufs.views for v in views]
        posted = dist.batch_isend_irecv([*ops, dist.P2POp(dist.isend, go, src_rank, tag=tag)])
        ends = list(itertools.accumulate(len(views) for views in bufs.views))
        works = [posted[end - len(views):end] for end, views in zip(ends, bufs.views)]
        try:
            copies = 0
            for i, piece_works in enumerate(works):
                if bufs.pairs[i] is not None:   # a staged piece is scattered while later ones arrive
                    _wait_all(piece_works)
                    copies += bufs.scatter(i)
            _wait_all(posted[::-1])   # a pair's messages complete in order: the last one's wait covers the rest
            self._count(copies, len(pieces), sent=False)
            return bufs.nbytes
        except BaseException:
            _wait_quietly(posted)
            raise
        finally:
            bufs.release()

    def _refuse(self, size: int, peer: int, tag: int) -> None:
        """A side that failed before it answered: send ``size`` entries of -1 (there is nothing), so that the peer,
        waiting for that message, is not left waiting; a channel that is gone already is logged, not raised over
        the failure being reported."""
        try:
            _wait_all([dist.isend(torch.full((size,), -1, dtype=torch.int64, device=self._control_device()),
                                  dst=peer, tag=tag)])
        except Exception as e:
            logger.warning("rank %d: could not tell rank %d that the migration failed: %s", self.books.rank, peer, e)

    def _plan(self, src: list[int], dst: list[int], pools: list[torch.Tensor]) -> list[list[int]]:
        block_bytes = sum(p[0].numel() * p.element_size() for p in pools)
        return plan_pieces(src, chunk_blocks=max(1, PIPELINE_BYTES // block_bytes), dst=dst)

    def _count(self, copies: int, pieces: int, sent: bool) -> None:
        c, staged = self.counts, copies > 0
        if sent:
            c.sent_pieces, c.gather_copies = c.sent_pieces + pieces, c.gather_copies + copies
            c.sent_gathered, c.sent_direct = c.sent_gathered + staged, c.sent_direct + (not staged)
        else:
            c.received_pieces, c.scatter_copies = c.received_pieces + pieces, c.scatter_copies + copies
            c.received_scattered, c.received_direct = c.received_scattered + staged, c.received_direct + (not staged)

    def _control_device(self) -> torch.device:
        """Where the negotiation's small messages live: the pool's device under NCCL, else the CPU."""
        return self.books.device if dist.get_backend() == "nccl" else torch.device("cpu")

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
            mgr.add_sequences([req], chunked=False)   # received whole: no context chunk is computed here
            first_new = mgr.admission(rid).reused_blocks
            if first_new >= num_blocks:
                mgr.remove_sequence(rid)
                return ImportTicket(rid, 0)
            slots = [mgr.blocks[b].slot for b in mgr.get_block_ids(rid)[first_new:num_blocks]]
            self._held[rid] = slots
            return ImportTicket(rid, len(slots))

    def import_write(self, import_id: int, data: torch.Tensor | None) -> int:
        """In-process path: scatter ``data`` (from ``export_read``) into the import's blocks and store them.

        A buffer of the wrong shape aborts the import (nothing is stored) and raises ``ValueError``.
        """
        with self.books.lock:
            slots = self._slots_of(import_id)
            pools = self.books.ledger().pools
            want = (len(slots), pools.elements_per_block)
            if data is None or tuple(data.shape) != want:
                self._abort(import_id)
                got = None if data is None else tuple(data.shape)
                raise ValueError(f"import {import_id}: got a buffer of shape {got}, expected {want} "
                                 "(blocks, elements of one block's K/V in every pool)")
            pools.write_blocks(slots, data.to(device=pools.device, dtype=self.books.template.dtype).contiguous())
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
        self.books.ledger().remove_sequence(import_id)   # stores the full blocks first: all but the extra token's
