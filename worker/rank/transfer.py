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


def message_size(num_tokens: int, tokens_per_block: int, max_blocks: int | None, windows: int) -> int:
    """Entries of one negotiation message (``_message``): a count, then per attention window a block count and at
    most ``header_blocks`` slots."""
    return 1 + windows * (1 + header_blocks(num_tokens, tokens_per_block, max_blocks))


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


def _message(count: int, slots: Sequence[Sequence[int]], size: int, device: torch.device) -> torch.Tensor:
    """One negotiation message: ``[count, len(slots[0]), ..., *slots[0], *slots[1], ...]`` (every attention window's
    slots) padded with -1 to ``size`` entries."""
    flat = [*(len(s) for s in slots), *(x for s in slots for x in s)]
    return torch.tensor([count, *flat, *[-1] * (size - 1 - len(flat))], dtype=torch.int64, device=device)


def _parse(message: torch.Tensor, windows: int) -> tuple[int, list[list[int]]]:
    """``_message``'s count and every window's slots; a negative count (a side that failed) has no slots."""
    values = message.tolist()
    count, lens = values[0], values[1:1 + windows]
    if count < 0:
        return count, []
    at = itertools.accumulate(lens, initial=1 + windows)
    return count, [values[a:a + n] for a, n in zip(at, lens)]


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
        self._held: dict[int, list[list[int]]] = {}   # pin or import id -> each window's slots to send or write
        self._prefixes: dict[int, int] = {}   # pin id -> blocks of the prefix pinned
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
        size = self._message_size(tokens, max_blocks)
        ctl = self._control_device()
        try:
            pools = self._pools()
            ticket = self.export_begin(tokens, max_blocks, lora_id, cache_salt)
        except BaseException:
            self._refuse(size, dst_rank, tag)
            raise
        try:
            n, slots = ticket.blocks, self._held[ticket.pin_id]
            header = _message(n, slots, size, ctl)
            if not n:   # the target asks nothing of a source that holds nothing
                _wait_all([dist.isend(header, dst=dst_rank, tag=tag)])
                return PrefixMoved(0, 0, 0, 0.0)
            reply = torch.empty(size, dtype=torch.int64, device=ctl)
            sent, got = _cross(header, reply, dst_rank, tag)
            works = [sent]
            got.wait()
            start, dst = _parse(reply, len(slots))
            if start < 0 or start >= n:   # the target failed (it reports why), or holds them all
                _wait_all(works)
                return PrefixMoved(n, 0, 0, 0.0)
            # the target lacks each window's last blocks: as many as it has slots for
            src = [own[len(own) - len(d):] for own, d in zip(slots, dst)]
            assert all(len(d) <= len(own) for own, d in zip(slots, dst)), f"target asks {dst} of pinned {slots}"
            self.books.faults.reached("migration_source")
            t0 = time.perf_counter()
            nbytes = self._send_pieces(list(zip(pools, src, dst)), dst_rank, tag, works)
            return PrefixMoved(n, n - start, nbytes, time.perf_counter() - t0)
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
        size = self._message_size(tokens, max_blocks)
        ctl = self._control_device()
        header = torch.empty(size, dtype=torch.int64, device=ctl)
        _wait_all([dist.irecv(header, src=src_rank, tag=tag)])
        n, src_slots = _parse(header, self._num_windows())
        if n <= 0:   # nothing to receive; or the source failed (it reports why)
            return PrefixMoved(max(n, 0), 0, 0, 0.0)
        try:   # until the answer goes, a failure answers -1, so that the source is not left waiting for it
            pools = self._pools()
            ticket = self.import_begin(tokens, n, lora_id, cache_salt)
        except BaseException:
            self._refuse(size, src_rank, tag)
            raise
        start = n - ticket.blocks
        if not ticket.blocks:   # it holds them all (the import is over already)
            _wait_all([dist.isend(_message(n, [[] for _ in src_slots], size, ctl), dst=src_rank, tag=tag)])
            return PrefixMoved(n, 0, 0, 0.0)
        try:
            src = self._lacked(ticket.import_id, src_slots)
            slots = self._align(ticket.import_id, n, src)
            self.books.faults.reached("migration_target")
        except BaseException:
            self.import_abort(ticket.import_id)
            self._refuse(size, src_rank, tag)
            raise
        try:
            t0 = time.perf_counter()
            nbytes = self._receive_pieces(list(zip(pools, src, slots)), src_rank, tag,
                                          _message(start, slots, size, ctl))
            self.books.defer(lambda: self._store(ticket.import_id))
            return PrefixMoved(n, n - start, nbytes, time.perf_counter() - t0)
        except BaseException:
            self.import_abort(ticket.import_id)
            raise

    def _lacked(self, import_id: int, src_slots: list[list[int]]) -> list[list[int]]:
        """Of each window's source slots (the prefix's last blocks the source pinned), those of the blocks the
        import lacks: the last ones, one per fresh block. A source whose windows keep other blocks than this
        rank's (another model) raises ``ValueError``."""
        fresh = self._held[import_id]
        if len(src_slots) != len(fresh) or any(len(f) > len(s) for f, s in zip(fresh, src_slots)):
            raise ValueError(f"rank {self.books.rank}: the source sent {[len(s) for s in src_slots]} blocks per "
                             f"attention window, this rank lacks {[len(f) for f in fresh]}: the two ranks' attention "
                             "windows differ")
        return [s[len(s) - len(f):] for s, f in zip(src_slots, fresh)]

    def _align(self, import_id: int, end: int, src: list[list[int]]) -> list[list[int]]:
        """Give the import's fresh blocks of each window (its positions before ``end``, receiving from source slots
        ``src``) the slots ``aligned_slots`` picks among their own, so that the target receives straight into its
        pool wherever both sides' slots run; returns them. Only the import holds these blocks and none holds KV
        yet, so exchanging their slots (as an offload exchanges two blocks' slots) changes nothing anyone else
        sees."""
        with self.books.lock:
            mgr = self.books.ledger()
            slots = [aligned_slots(s, own) for s, own in zip(src, self._held[import_id])]
            for w, own in enumerate(slots):
                mgr.arrange_slots(import_id, end - len(own), own, window=w)
            self._held[import_id] = slots
            return slots

    def _pools(self) -> list[list[torch.Tensor]]:
        """Every attention window's primary pools."""
        with self.books.lock:
            pools = [p.primary_pools for p in self.books.ledger().window_pools]
        if not pools[0]:
            raise ValueError(f"rank {self.books.rank} keeps no KV tensors: there are no bytes to send or receive")
        return pools

    def _num_windows(self) -> int:
        return len(self.books.template.window_layouts)

    def _message_size(self, tokens: Sequence[int], max_blocks: int | None) -> int:
        return message_size(len(tokens), self.books.template.tokens_per_block, max_blocks, self._num_windows())

    def _send_pieces(self, windows: list[tuple[list[torch.Tensor], list[int], list[int]]], dst_rank: int, tag: int,
                     works: list) -> int:
        """Post every piece's sends, window after window (``(pools, source slots, target slots)`` each), gathering
        a piece that is not one run just before its send, while earlier ones are on the wire; then wait for all,
        ``works`` posted before too; returns the bytes sent."""
        cut = [self._plan(src, dst, pools) for pools, src, dst in windows]
        bufs: list[_PieceBuffers] = []
        try:
            copies = 0
            for (pools, src, _), pieces in zip(windows, cut):
                bufs.append(b := _PieceBuffers(pools, [[src[i] for i in p] for p in pieces], self._send_staging))
                for i in range(len(pieces)):
                    copies += b.gather(i)
                    works.extend(dist.isend(v, dst=dst_rank, tag=tag) for v in b.views[i])
            _wait_all(works[::-1])   # a pair's messages complete in order: the last one's wait covers the rest
            self._count(copies, sum(map(len, cut)), sent=True)
            return sum(b.nbytes for b in bufs)
        except BaseException:
            _wait_quietly(works)
            raise
        finally:
            for b in bufs:
                b.release()

    def _receive_pieces(self, windows: list[tuple[list[torch.Tensor], list[int], list[int]]], src_rank: int,
                        tag: int, go: torch.Tensor) -> int:
        """Receive each window's blocks (``(pools, source slots, target slots)``) into its pools, in the pieces
        both sides cut alike: post every receive, then send ``go`` (the answer the source waits for, in the same
        batch: NCCL runs a pair's operations in order), then wait, scattering each staged piece while later ones
        arrive; returns the bytes received."""
        bufs, pieces = [], []
        try:
            for pools, src, dst in windows:
                cut = self._plan(src, dst, pools)
                bufs.append(_PieceBuffers(pools, [[dst[i] for i in p] for p in cut], self._recv_staging))
                pieces += [(bufs[-1], i) for i in range(len(cut))]
        except BaseException:
            for b in bufs:
                b.release()
            raise
        ops = [dist.P2POp(dist.irecv, v, src_rank, tag=tag) for b, i in pieces for v in b.views[i]]
        posted = dist.batch_isend_irecv([*ops, dist.P2POp(dist.isend, go, src_rank, tag=tag)])
        ends = list(itertools.accumulate(len(b.views[i]) for b, i in pieces))
        works = [posted[end - len(b.views[i]):end] for end, (b, i) in zip(ends, pieces)]
        try:
            copies = 0
            for (b, i), piece_works in zip(pieces, works):
                if b.pairs[i] is not None:   # a staged piece is scattered while later ones arrive
                    _wait_all(piece_works)
                    copies += b.scatter(i)
            _wait_all(posted[::-1])   # a pair's messages complete in order: the last one's wait covers the rest
            self._count(copies, len(pieces), sent=False)
            return sum(b.nbytes for b in bufs)
        except BaseException:
            _wait_quietly(posted)
            raise
        finally:
            for b in bufs:
                b.release()

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
        """Pin the stored full blocks matching ``tokens`` (host-tier ones are onboarded first): of every attention
        window, those a request past the prefix reuses (``KVCacheManager.pin_prefix``)."""
        pin_id = next(_INTERNAL_IDS)
        with self.books.lock:
            pinned = self.books.ledger().pin_prefix(pin_id, tokens, lora_id=lora_id, cache_salt=cache_salt,
                                                    max_blocks=max_blocks)
            self._held[pin_id] = list(pinned.slots)
            self._prefixes[pin_id] = pinned.blocks
        return ExportTicket(pin_id, pinned.blocks)

    def export_read(self, pin_id: int, start: int) -> list[torch.Tensor]:
        """In-process path: the pinned blocks of prefix positions ``start..``, one tensor per attention window
        (``TieredPools.read_blocks``' rows; none where the window keeps no block there), then unpinned."""
        try:
            with self.books.lock:
                mgr, end = self.books.ledger(), self._prefixes[pin_id]
                return [pools.read_blocks(slots[max(0, start - (end - len(slots))):])
                        for pools, slots in zip(mgr.window_pools, self._held[pin_id])]
        finally:
            self.export_end(pin_id)

    def export_end(self, pin_id: int) -> None:
        """Release a pin (idempotent: a send that already released it is fine)."""
        with self.books.lock:
            self._prefixes.pop(pin_id, None)
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
            mgr.add_sequences([req], received=True)   # received whole: no context chunk is computed here
            first_new = mgr.admission(rid).reused_blocks
            if first_new >= num_blocks:
                mgr.remove_sequence(rid)
                return ImportTicket(rid, 0)
            self._held[rid] = list(mgr.window_slots(rid, first_new, num_blocks))
            return ImportTicket(rid, num_blocks - first_new)

    def import_write(self, import_id: int, data: Sequence[torch.Tensor]) -> int:
        """In-process path: scatter ``data`` (from ``export_read``: a tensor per attention window) into the import's
        blocks and store them; returns the blocks written.

        Buffers of the wrong shape abort the import (nothing is stored) and raise ``ValueError``.
        """
        with self.books.lock:
            slots = self._slots_of(import_id)
            pools = self.books.ledger().window_pools
            want = [(len(s), p.elements_per_block) for s, p in zip(slots, pools)]
            got = [tuple(d.shape) for d in data] if isinstance(data, (list, tuple)) and all(
                isinstance(d, torch.Tensor) for d in data) else None
            if got != want:
                self._abort(import_id)
                raise ValueError(f"import {import_id}: got buffers of shapes {got}, expected {want} (per attention "
                                 "window: blocks, elements of one block's K/V in every pool of the window)")
            for s, p, d in zip(slots, pools, data):
                p.write_blocks(s, d.to(device=p.device, dtype=self.books.template.dtype).contiguous())
            self._store(import_id)
        return sum(map(len, slots))

    def import_commit(self, import_id: int) -> int:
        """Books-only path: store the import's blocks with no data to write (a ledger without tensors only)."""
        with self.books.lock:
            slots = self._slots_of(import_id)
            if self.books.ledger().pools.primary_pools:
                self._abort(import_id)
                raise ValueError(f"import {import_id}: this ledger keeps KV tensors; committing without data "
                                 "would store blocks whose KV was never written")
            self._store(import_id)
        return sum(map(len, slots))

    def _slots_of(self, import_id: int) -> list[list[int]]:
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
