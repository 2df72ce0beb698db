"""Small factories for the router's index tests: stand-in hashes, events, batches, and the index as the feed
builds it."""
from __future__ import annotations

from kvledger.router.groups import WindowedArrayIndex
from kvledger.router.index import BlockIndex
from kvledger.router.numbering import SequencedIndex
from kvledger.worker.wire.events import BlockRemoved, BlockStored, EventBatch

TPB = 4
H = [0x1000 + i for i in range(32)]   # stand-in chained hashes: the index treats hashes as opaque


def stored(hashes, parent=None, medium="GPU"):
    return BlockStored(list(hashes), parent, [7] * (TPB * len(hashes)), TPB, medium=medium)


def removed(hashes, medium="GPU"):
    return BlockRemoved(list(hashes), medium)


def batch(*events, rank=None):
    return EventBatch(0.0, list(events), rank)


def state(index: SequencedIndex, ranks=range(4), hashes=H):
    """Everything observable: numbering, waiting flags, refs per (rank, hash), holders per hash."""
    return ({r: (index.next_seq(r), index.awaiting_snapshot(r)) for r in ranks},
            {(r, h): index.store.refs(r, h) for r in ranks for h in hashes},
            {h: index.store.holders(h) for h in hashes}, index.num_blocks())


def make_index(store: type[BlockIndex] = WindowedArrayIndex) -> SequencedIndex:
    """The numbering in front of the windowed block store, as ``EventFeed`` builds it (``store``: the reference,
    ``WindowedIndex``, for tests of its chain books)."""
    return SequencedIndex(store(TPB))


def ingest(index: SequencedIndex, rank: int, seq: int, data: bytes):
    return index.ingest(rank, seq, data)[0]
