"""The array store against the reference: ``ArrayIndex`` and ``PrefixIndex`` (and their ``Windowed`` forms) fed
the same random streams give the same answers after every step, rollback reasons and errors included."""
from __future__ import annotations

import logging
import random

import pytest

from kvledger.router import index_kernels
from kvledger.worker.wire import int_arrays
from kvledger.router.array_index import ArrayIndex, warm_kernels
from kvledger.router.groups import WindowedArrayIndex, WindowedIndex
from kvledger.router.index import PrefixIndex, as_pair
from kvledger.router.snapshot import SnapshotBlock
from kvledger.worker.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, BlockUpdated, KVCacheCreated

TPB = 4
SIZES = (TPB, 8, 16)
MEDIA = ("GPU", "CPU", None)
WINDOW = 2 * TPB


def chains(rng: random.Random) -> dict[int, list[list[int]]]:
    """Per block size, documents of 40 blocks sharing prefixes in pairs; hashes anywhere in u64."""
    out = {}
    for size in SIZES:
        docs = []
        for d in range(8):
            shared = docs[-1][:rng.randrange(1, 20)] if d % 2 else []
            docs.append(shared + [rng.choice((rng.getrandbits(64), rng.getrandbits(8)))
                                  for _ in range(40 - len(shared))])
        out[size] = docs
    return out


class Stream:
    """Random steps for both stores: batches of every event kind, snapshots, removals, block size changes."""

    def __init__(self, seed: int, ranks: list[int], windowed: bool) -> None:
        self.rng = random.Random(seed)
        self.docs = chains(self.rng)
        self.ranks = ranks
        self.windowed = windowed
        self.sizes = dict.fromkeys(ranks, TPB)
        self.held: dict[int, list[int]] = {r: [] for r in ranks}   # hashes each rank was told to store, roughly

    def run(self, size: int) -> tuple[list[int], int | None]:
        doc = self.rng.choice(self.docs[size])
        lo = self.rng.randrange(len(doc))
        hi = min(len(doc), lo + self.rng.randrange(1, 12))
        return doc[lo:hi], doc[lo - 1] if lo else None

    def event(self, rank: int) -> object:
        rng, size = self.rng, self.sizes[rank]
        group = 1 if self.windowed and rng.random() < 0.3 else 0
        pick = rng.random()
        if pick < 0.45:
            hs, parent = self.run(size)
            self.held[rank] += hs
            kind, window = (("sliding_window", WINDOW) if group else ("full_attention", None)) if self.windowed \
                else (None, None)
            return BlockStored(hs, parent, [], size, medium=rng.choice(MEDIA), group_idx=group,
                               kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)
        known = self.held[rank] or self.run(size)[0]
        if pick < 0.75:
            hs = rng.sample(known, min(len(known), rng.randrange(1, 6)))
            if rng.random() < 0.1:
                hs.append(self.run(size)[0][0])   # likely not held: the batch rolls back
            return BlockRemoved(hs, rng.choice(MEDIA), group)
        if pick < 0.92:
            old, new = rng.choice(MEDIA), rng.choice(MEDIA)
            return BlockUpdated(rng.choice(known), old, new, None, rng.choice((None, 3)), group)
        if pick < 0.97:
            self.held[rank] = []
            return AllBlocksCleared()
        return KVCacheCreated({"GPU": 100}, size if rng.random() < 0.9 else size + 1)

    def step(self) -> tuple[str, int, object]:
        rng = self.rng
        rank = rng.choice(self.ranks)
        pick = rng.random()
        if pick < 0.85:
            return "apply", rank, [self.event(rank) for _ in range(rng.randrange(0, 6))]
        if pick < 0.92:
            hs = [h for _ in range(rng.randrange(0, 3)) for h in self.run(self.sizes[rank])[0]]
            self.held[rank] = list(hs)
            return "load_snapshot", rank, [SnapshotBlock(h, rng.choice(("GPU", "CPU"))) for h in hs]
        if pick < 0.97:
            self.held[rank] = []
            return "remove_rank", rank, None
        self.sizes[rank] = rng.choice(SIZES)
        self.held[rank] = []
        return "set_block_size", rank, self.sizes[rank]

    def queries(self) -> list[list[int]]:
        return [doc[:self.rng.randrange(1, len(doc) + 1)] for size in SIZES for doc in self.docs[size]]


def outcome(store: object, what: str, rank: int, arg: object) -> object:
    """What one step returned, or the error it raised (type and message)."""
    try:
        if what == "remove_rank":
            return store.remove_rank(rank)
        return getattr(store, what)(rank, arg)
    except (TypeError, ValueError) as e:
        return type(e), str(e)


def answers(store: object, stream: Stream, queries: list[list[int]]) -> object:
    ranks = store.ranks()
    return ([store.match(q, as_pair) for q in queries], [list(store.match(q, as_pair)) for q in queries],
            store.num_blocks(), ranks, store.other_block_sizes(),
            {r: (store.num_blocks(r), store.host_only_blocks(r), store.block_size(r), store.held(r)) for r in ranks})


@pytest.mark.parametrize(("seed", "ranks", "windowed"), [
    (0, list(range(4)), False),
    (1, list(range(80)), False),                     # past one 64-bit word of holder bits
    (2, [0, 1, 63, 64, 255, 256, 300, 1000, 1001], False),
    (3, list(range(0, 300, 3)), False),              # 100 ranks, ids past 256
    (4, list(range(6)), True),
    (5, list(range(70)) + [256, 1000], True),
])
def test_array_store_answers_as_the_reference(seed, ranks, windowed):
    stream = Stream(seed, ranks, windowed)
    ref, arr = (WindowedIndex(TPB), WindowedArrayIndex(TPB)) if windowed else (PrefixIndex(TPB), ArrayIndex(TPB))
    rollbacks = 0
    for n in range(300 if len(ranks) < 10 else 700):
        what, rank, arg = stream.step()
        got = outcome(arr, what, rank, arg)
        assert got == outcome(ref, what, rank, arg), (n, what, rank, arg)
        rollbacks += type(got) is str
        if n % 5 == 0 or what != "apply":
            queries = stream.queries()
            assert answers(arr, stream, queries) == answers(ref, stream, queries), (n, what, rank)
    assert rollbacks > 10   # the streams do reach the rollback path


def test_array_store_grows_past_its_first_tables():
    """Tens of thousands of blocks over many ranks: the tables grow (by half) and the masks widen."""
    rng = random.Random(7)
    ref, arr = PrefixIndex(TPB), ArrayIndex(TPB)
    docs = [[rng.getrandbits(64) for _ in range(200)] for _ in range(100)]
    for i, doc in enumerate(docs):
        rank = (i * 37) % 200
        for store in (ref, arr):
            assert store.apply(rank, [BlockStored(doc, None, [], TPB), BlockRemoved(doc[150:])]) is None
    for doc in docs[::7]:
        assert arr.match(doc, as_pair) == ref.match(doc, as_pair)
    assert arr.num_blocks() == ref.num_blocks() == 15_000
    for rank in range(0, 200, 2):
        arr.remove_rank(rank)
        ref.remove_rank(rank)
    assert [arr.match(d, as_pair) for d in docs] == [ref.match(d, as_pair) for d in docs]
    assert arr.num_blocks() == ref.num_blocks()


def test_warming_compiles_the_kernels_once_and_says_so(caplog):
    warm_kernels.cache_clear()
    with caplog.at_level(logging.INFO, logger="kvledger.router.array_index"):
        warm_kernels()
        warm_kernels()
    assert [r.getMessage() for r in caplog.records].count("compiling the index kernels (once; cached on disk)") == 1
    for kernel in (index_kernels.rehash, index_kernels.rebuild_masks, index_kernels.apply_ops,
                   index_kernels.match_walk,   # a store's first growth compiles nothing mid-request
                   int_arrays._all_non_negative):   # nor a batch's token ids
        assert kernel.signatures, kernel
