"""KV migration between two ranks: which blocks move, and the rule every cluster shares.

A prompt's prefix blocks move from rank A to rank B: the source pins the
blocks it holds, the target allocates the ones it lacks (sharing whatever
prefix it already has), their KV crosses, and the target stores them in its
tree (reusable, announced with ``BlockStored``), releasing the source's pin. If
anything fails after the pin, the pin is released and the import aborted, so
no block whose KV was not written is ever stored, and nothing stays pinned.

The steps are the rank's (``kvledger.worker.rank.transfer``); who drives them
differs. Rank actors run them themselves, one call per side launched together
and negotiating over their process group (``kvledger.coordinator.cluster``):
one round trip per migration. Ranks in this process, and ledgers that keep only
the books (the replay simulator), are driven step by step by ``migrate_prefix``
through the rank interface (``export_begin`` / ``export_end``, ``import_begin``
/ ``import_abort``), with a ``BlockMover`` for the bytes: a tensor handed over,
or nothing at all. ``Migrator`` adds the one rule every cluster shares:
transfers between one pair of ranks never interleave.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvledger.worker.wire.messages import ExportTicket, ImportTicket

logger = logging.getLogger(__name__)


class MigrationEnd(Protocol):
    """One side of a migration (a ``RankClient`` is one)."""

    def export_begin(self, tokens: Sequence[int], max_blocks: int | None = None, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ExportTicket: ...

    def export_end(self, pin_id: int) -> None: ...

    def import_begin(self, tokens: Sequence[int], num_blocks: int, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ImportTicket: ...

    def import_abort(self, import_id: int) -> None: ...


class BlockMover(Protocol):
    """Carries the KV of an import's blocks from the source's pin; the target stores them, the pin is released."""

    def move(self, export: ExportTicket, start: int, target: ImportTicket) -> int:
        """Move pinned blocks ``start..`` into the import; returns the bytes moved."""
        ...


@dataclass(frozen=True, slots=True)
class MigrationResult:
    src: int
    dst: int
    matched_blocks: int
    """Full prefix blocks the source held (and pinned)."""
    sent_blocks: int
    """Blocks that crossed (the target already held the others)."""
    bytes: int
    seconds: float
    """Wall time of the move itself, after both sides were prepared."""


def migrate_prefix(src: MigrationEnd, dst: MigrationEnd, mover: BlockMover, tokens: Sequence[int],
                   src_rank: int, dst_rank: int, max_blocks: int | None = None, lora_id: int | None = None,
                   cache_salt: str | None = None) -> MigrationResult:
    """Move the prefix blocks of prompt ``tokens`` that ``src`` holds (at most ``max_blocks``) to ``dst``."""
    tokens = list(tokens)
    export = src.export_begin(tokens, max_blocks, lora_id, cache_salt)
    if export.blocks == 0:
        src.export_end(export.pin_id)
        return MigrationResult(src_rank, dst_rank, 0, 0, 0, 0.0)
    try:
        target = dst.import_begin(tokens, export.blocks, lora_id, cache_salt)
    except BaseException:
        src.export_end(export.pin_id)
        raise
    if target.blocks == 0:
        src.export_end(export.pin_id)
        return MigrationResult(src_rank, dst_rank, export.blocks, 0, 0, 0.0)
    t0 = time.perf_counter()
    try:
        nbytes = mover.move(export, export.blocks - target.blocks, target)
    except BaseException:
        _undo(src.export_end, export.pin_id, src_rank)
        _undo(dst.import_abort, target.import_id, dst_rank)
        raise
    return MigrationResult(src_rank, dst_rank, export.blocks, target.blocks, nbytes, time.perf_counter() - t0)


def _undo(step: Callable[[int], None], ticket: int, rank: int) -> None:
    """One side's clean-up after a failed move; a side that cannot be reached (its ledger went with it) is
    logged, so the failure that stopped the move is the one the caller sees."""
    try:
        step(ticket)
    except Exception as e:
        logger.warning("rank %d: releasing migration ticket %d failed: %s", rank, ticket, e)


class PrefixTransfer(Protocol):
    """One whole migration between two ranks of a cluster, however its steps are driven."""

    def __call__(self, tokens: list[int], src: int, dst: int, max_blocks: int | None, lora_id: int | None,
                 cache_salt: str | None) -> MigrationResult: ...


def stepwise(ends: Callable[[int], MigrationEnd], mover: Callable[[int, int], BlockMover]) -> PrefixTransfer:
    """Migrations driven step by step from here (``migrate_prefix``): ``ends(rank)`` reaches a rank,
    ``mover(src, dst)`` moves the bytes between two."""

    def transfer(tokens: list[int], src: int, dst: int, max_blocks: int | None, lora_id: int | None,
                 cache_salt: str | None) -> MigrationResult:
        return migrate_prefix(ends(src), ends(dst), mover(src, dst), tokens, src, dst, max_blocks, lora_id,
                              cache_salt)

    return transfer


class Migrator:
    """Migrations within one cluster, each carried out by ``transfer``.

    One lock per unordered pair keeps two transfers between the same ranks from
    interleaving on their shared channel; transfers between other pairs go on.
    """

    def __init__(self, transfer: PrefixTransfer) -> None:
        self._transfer = transfer
        self._locks: dict[frozenset[int], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _pair_lock(self, a: int, b: int) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(frozenset((a, b)), threading.Lock())

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None = None,
                lora_id: int | None = None, cache_salt: str | None = None) -> MigrationResult:
        if src == dst:
            raise ValueError(f"migrate needs two different ranks, got {src} twice")
        if max_blocks is not None and (type(max_blocks) is not int or max_blocks < 0):
            raise ValueError(f"migrate: max_blocks must be None or an int >= 0, got {max_blocks!r}")
        with self._pair_lock(src, dst):
            return self._transfer(list(tokens), src, dst, max_blocks, lora_id, cache_salt)
