"""Microseconds per block of the ledger's hot operations, side by side with vLLM's ``BlockPool``.

Both sides get the same token stream in the same process, with block events
on and drained (``take_events``) inside every timed region. Operations:

1. allocate + store: admit a prompt that matches nothing, store its full blocks.
2. lookup + reuse: admit a prompt whose full blocks are all cached (and free),
   reuse them, allocate the trailing partial block, store (nothing new).
3. free: finish a request: release its blocks and drop its state (ours: the
   ledger's sequence; vLLM: its ``Request``, which its scheduler deletes as it
   frees the blocks). Ours also re-walks its stored blocks.
4. allocation under eviction, no offload: admit a new prompt into a pool full
   of cached, unreferenced blocks, so nearly every block is an eviction.
5. allocation under eviction with offload: as 4, but our ledger moves each
   evicted block to a full host tier (which drops its own victim). vLLM's
   pool has no host tier, so its column repeats row 4 (plain eviction).
6-8. operations 1-3 for a two-window model (Gemma-style: a layer sliding over
   ``WINDOW`` tokens and a full-attention layer): our ledger with
   ``attention_windows``, one window manager each; vLLM's ``BlockPool`` driven
   as its hybrid coordinator drives it for two KV cache groups, a full-attention
   group and a sliding-window group that looks up only the blocks of the last
   window (right to left) and holds its null block elsewhere.

Hashing: our ledger builds block keys in ``add_sequence`` and hashes in the
store, so on vLLM's side creating the ``Request`` (which computes its sha256
block hashes) is inside the timed region of rows 1, 2, 4 and 5 too.
Our ledgers are metadata-only (``materialize=False``): no tensors, no copies.

    python benchmarks/bench_ledger.py            # full run, < 3 minutes
    python benchmarks/bench_ledger.py --quick    # a few seconds
    python benchmarks/bench_ledger.py --profile  # also cProfile our side where ours/vLLM > 1

The peer is loaded from ``shared/peers/vllm_blockpool.py`` (next to the repository
or inside it, or ``$KVLEDGER_PEERS_DIR``); it needs ``pip install msgspec pyzmq cbor2``.
When it cannot be loaded the benchmark says why and prints our numbers alone.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import importlib
import io
import os
import pstats
import random
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run as a script: make the repository's packages importable
    sys.path.insert(0, str(_REPO))

from kvledger.worker.ledger import CacheConfig, KVCacheManager, Request  # noqa: E402
from kvledger.worker.wire.events import BlockRemoved, BlockUpdated  # noqa: E402

VOCAB = 128_256
"""Token ids are drawn below this (Llama 3's vocabulary)."""
WINDOW = 1024
"""Tokens the sliding layer of the two-window model (rows 6-8) attends to."""


@dataclass(frozen=True)
class BenchSizes:
    """How big and how long one run is."""

    tokens_per_block: int = 16
    """Tokens per block on both sides."""
    pool_blocks: int = 16_384
    """Device blocks of each pool."""
    host_blocks: int = 16_384
    """Host-tier blocks of our ledger in operation 5."""
    min_prompt_blocks: int = 64
    """Shortest prompt, in full blocks (every prompt has one more token, a partial block)."""
    max_prompt_blocks: int = 256
    """Longest prompt, in full blocks."""
    requests_per_rep: int = 48
    """Prompts per repetition; all of them are held at once in operations 1-3, so they must fit the pool."""
    reps: int = 15
    """Timed repetitions; the table shows their median."""
    warmup_reps: int = 1
    """Untimed repetitions run first."""
    seed: int = 0
    """Seed of the token stream."""

    def __post_init__(self) -> None:
        if self.requests_per_rep * (self.max_prompt_blocks + 1) > self.pool_blocks - 1:
            raise ValueError("requests_per_rep * (max_prompt_blocks + 1) must fit in pool_blocks - 1")


QUICK = BenchSizes(pool_blocks=8_192, host_blocks=8_192, requests_per_rep=12, reps=3)


# ---------------------------------------------------------------------------- the token stream


class PromptStream:
    """Unique random prompts of ``k * T + 1`` tokens: ``k`` full blocks and one partial block.

    The first token is unique per prompt, so no two prompts share even a partial first block.
    """

    def __init__(self, sizes: BenchSizes) -> None:
        self._rng = random.Random(sizes.seed)
        self._sizes = sizes
        self._count = 0

    def take(self, n: int) -> list[list[int]]:
        s, out = self._sizes, []
        for _ in range(n):
            k = self._rng.randint(s.min_prompt_blocks, s.max_prompt_blocks)
            toks = [self._rng.randrange(VOCAB) for _ in range(k * s.tokens_per_block + 1)]
            toks[0] = self._count % VOCAB
            self._count += 1
            out.append(toks)
        return out


def blocks_of(tokens: list[int], T: int) -> int:
    return -(-len(tokens) // T)


# ---------------------------------------------------------------------------- timing


class Stopwatch:
    """Sums the time of its ``with`` blocks; optionally profiles exactly those blocks.

    ``clock`` is wall time by default; ``time.thread_time_ns`` (CPU time of this
    thread) keeps other processes on a shared machine from inflating the numbers.
    """

    __slots__ = ("ns", "profile", "clock", "_t0")

    def __init__(self, profile: cProfile.Profile | None = None,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.ns = 0
        self.profile = profile
        self.clock = clock
        self._t0 = 0

    def __enter__(self) -> None:
        if self.profile is not None:
            self.profile.enable()
        self._t0 = self.clock()

    def __exit__(self, *exc: object) -> None:
        self.ns += self.clock() - self._t0
        if self.profile is not None:
            self.profile.disable()


# ---------------------------------------------------------------------------- the two sides


class OursSide:
    """Our ledger, metadata only, driven the way an engine drives it."""

    name = "ours"

    def __init__(self, sizes: BenchSizes, host_blocks: int = 0, two_windows: bool = False) -> None:
        self.T = sizes.tokens_per_block
        windows = dict(num_layers=2, attention_windows=(WINDOW, None),
                       window_blocks=((sizes.pool_blocks, 0),) * 2) if two_windows else {}
        cfg = CacheConfig(tokens_per_block=self.T, num_primary_blocks=sizes.pool_blocks,
                          num_secondary_blocks=host_blocks, materialize=False, device="cpu",
                          offload_min_priority=0 if host_blocks else 101, event_buffer_size=100_000, **windows)
        self.mgr = KVCacheManager(cfg)
        self.mgr.take_events()
        self._next_id = 0
        self.events: list = []

    def admit(self, tokens: list[int]) -> tuple[int, int]:
        """Admission only (validation, keys, match, allocation); returns (handle, reused full blocks)."""
        rid, self._next_id = self._next_id, self._next_id + 1
        pre = self.mgr.add_sequence(Request(rid, tokens))
        self.events = self.mgr.take_events()
        return rid, pre // self.T

    def admit_store(self, tokens: list[int]) -> tuple[int, int]:
        """Admission, then storing the prompt's full blocks (hashing them) as after prefill."""
        rid, self._next_id = self._next_id, self._next_id + 1
        pre = self.mgr.add_sequence(Request(rid, tokens))
        self.mgr.store_context_blocks(rid)
        self.events = self.mgr.take_events()
        return rid, pre // self.T

    def store(self, handle: int) -> None:
        self.mgr.store_context_blocks(handle)
        self.events = self.mgr.take_events()

    def free(self, handle: int) -> None:
        self.mgr.remove_sequence(handle)
        self.events = self.mgr.take_events()

    def evicted(self) -> int:
        """Blocks dropped from the device tier in the last drained events (offloads count too)."""
        n = 0
        for e in self.events:
            if isinstance(e, BlockRemoved) and e.medium == "GPU":
                n += len(e.block_hashes)
            elif isinstance(e, BlockUpdated) and e.old_medium == "GPU":
                n += 1
        return n


class VllmSide:
    """vLLM 0.33's BlockPool, driven the way its KVCacheManager drives it (one KV cache group)."""

    name = "vLLM"

    def __init__(self, vp: types.SimpleNamespace, sizes: BenchSizes, two_windows: bool = False) -> None:
        self.vp = vp
        self.T = sizes.tokens_per_block
        self.groups = 2 if two_windows else 1
        """KV cache groups: group 0 full attention, group 1 (two windows) sliding over ``WINDOW`` tokens."""
        self.pool = vp.BlockPool(num_gpu_blocks=sizes.pool_blocks * self.groups, enable_caching=True,
                                 hash_block_size=self.T, enable_kv_cache_events=True)
        self.pool.take_events()
        self._next_id = 0
        self.events: list = []

    def _admit(self, tokens: list[int]) -> tuple[object, list[list], int]:
        rid, self._next_id = self._next_id, self._next_id + 1
        req = self.vp.Request(str(rid), tokens, self.T)  # computes the sha256 block hashes
        pool, T = self.pool, self.T
        hit = []
        for h in req.block_hashes[:(len(tokens) - 1) // T]:  # vLLM never matches the last token
            cached = pool.get_cached_block(h, [0])
            if cached is None:
                break
            hit.append(cached[0])
        groups = [hit]
        if self.groups == 2:   # its SlidingWindowManager: the last window's blocks, found right to left
            need, window = -(-(WINDOW - 1) // T), []
            for h in reversed(req.block_hashes[:len(hit)]):
                cached = pool.get_cached_block(h, [1])
                if cached is None or len(window) == need:
                    break
                window.append(cached[0])
            if len(window) < min(need, len(hit)):
                window, hit[:] = [], []
            groups.append([pool.null_block] * (len(hit) - len(window)) + window[::-1])
        for g in groups:
            pool.touch(g)
        n = blocks_of(tokens, T) - len(hit)
        return req, [g + pool.get_new_blocks(n) for g in groups], len(hit)

    def admit(self, tokens: list[int]) -> tuple[tuple, int]:
        req, blocks, n_hit = self._admit(tokens)
        self.events = self.pool.take_events()
        return (req, blocks, n_hit), n_hit

    def admit_store(self, tokens: list[int]) -> tuple[tuple, int]:
        """What the scheduler does for a new request, then caching its full blocks (no-op when all hit)."""
        req, blocks, n_hit = self._admit(tokens)
        n_full = len(tokens) // self.T
        for g, group_blocks in enumerate(blocks):
            self.pool.cache_full_blocks(req, group_blocks, n_hit, n_full, self.T, g)
        self.events = self.pool.take_events()
        return (req, blocks, n_full), n_hit

    def store(self, handle: tuple) -> None:
        req, blocks, n_cached = handle
        for g, group_blocks in enumerate(blocks):
            self.pool.cache_full_blocks(req, group_blocks, n_cached, len(req.all_token_ids) // self.T, self.T, g)
        self.events = self.pool.take_events()

    def free(self, handle: tuple) -> None:
        for group_blocks in handle[1]:
            self.pool.free_blocks(reversed(group_blocks))
        self.events = self.pool.take_events()

    def evicted(self) -> int:
        return sum(len(e.block_hashes) for e in self.events if type(e).__name__ == "BlockRemoved")


# ---------------------------------------------------------------------------- the operations


@dataclass
class Sample:
    """One repetition of one operation on one side."""

    ns: int = 0
    blocks: int = 0
    evicted: int = 0

    @property
    def us_per_block(self) -> float:
        return self.ns / 1000 / self.blocks


def _interleaved(sides: list, i: int) -> list:
    """Both sides take turns prompt by prompt (first one, then the other), so they share the machine's noise."""
    return sides if i % 2 == 0 else sides[::-1]


def run_alloc_lookup_free(sides: list, prompts: list[list[int]],
                          watches: dict[str, dict[str, Stopwatch]]) -> dict[str, dict[str, Sample]]:
    """Operations 1-3 on fresh pools: allocate + store every prompt, free them all, look them all up again.

    Returns samples[op][side name]; ``watches[side name][op]`` times (and maybe profiles) each region.
    """
    T = sides[0].T
    nblk = sum(blocks_of(p, T) for p in prompts)
    handles: dict[str, list] = {s.name: [] for s in sides}
    for i, p in enumerate(prompts):
        for side in _interleaved(sides, i):
            with watches[side.name]["alloc_store"]:
                h, hit = side.admit_store(p)
            assert hit == 0, f"{side.name}: a fresh prompt matched {hit} blocks"
            handles[side.name].append(h)
    for i in range(len(prompts)):
        for side in _interleaved(sides, i):
            live = handles[side.name]
            with watches[side.name]["free"]:
                side.free(live[i])
                live[i] = None  # finishing a request drops its state with its blocks (vLLM's scheduler too)
    handles = {s.name: [] for s in sides}
    for i, p in enumerate(prompts):
        for side in _interleaved(sides, i):
            with watches[side.name]["lookup"]:
                h, hit = side.admit_store(p)
            assert hit == len(p) // T, f"{side.name}: lookup reused {hit} of {len(p) // T} blocks"
            handles[side.name].append(h)
    for side in sides:
        for h in handles[side.name]:
            side.free(h)
    return {op: {s.name: Sample(ns=watches[s.name][op].ns, blocks=nblk) for s in sides}
            for op in ("alloc_store", "free", "lookup")}


def prefill(side, stream_prompts: list[list[int]]) -> None:
    """Fill a pool (and host tier) with cached, unreferenced blocks."""
    for p in stream_prompts:
        h, _ = side.admit_store(p)
        side.free(h)


def run_evict(sides: list, prompts: list[list[int]], watches: list[Stopwatch]) -> list[Sample]:
    """Admit new prompts into full pools; storing and freeing them afterwards is not timed."""
    out = [Sample() for _ in sides]
    for i, p in enumerate(prompts):
        order = list(zip(sides, watches, out))
        for side, sw, s in _interleaved(order, i):
            with sw:
                h, _ = side.admit(p)
            s.evicted += side.evicted()
            s.blocks += blocks_of(p, side.T)
            side.store(h)
            side.free(h)
    for sw, s in zip(watches, out):
        s.ns = sw.ns
    return out


# ---------------------------------------------------------------------------- the peer


def load_peer() -> tuple[types.SimpleNamespace | None, str]:
    """vLLM's BlockPool namespace, or None and the reason it could not be loaded."""
    candidates = [os.environ.get("KVLEDGER_PEERS_DIR"), _REPO / "shared" / "peers", _REPO.parent / "shared" / "peers"]
    for c in candidates:
        if c and (Path(c) / "vllm_blockpool.py").exists():
            sys.path.insert(0, str(c))
            break
    else:
        return None, "shared/peers/vllm_blockpool.py not found (set KVLEDGER_PEERS_DIR)"
    try:
        return importlib.import_module("vllm_blockpool").load(), ""
    except Exception as e:  # noqa: BLE001 - any failure to load the peer only drops its column
        return None, f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------- the run

ROWS = (
    ("alloc_store", "1 allocate + store"),
    ("lookup", "2 lookup + reuse"),
    ("free", "3 free"),
    ("evict", "4 alloc under eviction"),
    ("evict_offload", "5 alloc under evict+offload"),
    ("alloc_store_2w", "6 two windows: alloc + store"),
    ("lookup_2w", "7 two windows: lookup + reuse"),
    ("free_2w", "8 two windows: free"),
)


def run(sizes: BenchSizes, vp: types.SimpleNamespace | None,
        profiles: dict[str, cProfile.Profile] | None = None,
        clock: Callable[[], int] = time.perf_counter_ns) -> dict[str, dict[str, list[Sample]]]:
    """All operations, ours and vLLM's interleaved prompt by prompt; returns samples[op][side name].

    The garbage collector is off while this runs (as ``timeit`` does) and collects between
    repetitions, so one side's garbage is never collected on the other side's clock.
    """
    profiles = profiles or {}
    stream = PromptStream(sizes)
    samples: dict[str, dict[str, list[Sample]]] = {op: {"ours": [], "vLLM": []} for op, _ in ROWS}
    avg_blocks = (sizes.min_prompt_blocks + sizes.max_prompt_blocks) / 2 + 1

    def fill(n_blocks: int) -> list[list[int]]:
        return stream.take(int(n_blocks / avg_blocks * 1.2) + 2)

    def watch(side_name: str, op: str, timed: bool) -> Stopwatch:
        return Stopwatch(profiles.get(op) if timed and side_name == "ours" else None, clock)

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        # persistent pools for the eviction rows, filled with cached blocks
        evict_sides = [OursSide(sizes)] + ([VllmSide(vp, sizes)] if vp else [])
        offload_side = OursSide(sizes, host_blocks=sizes.host_blocks)
        warm = fill(sizes.pool_blocks)
        for side in evict_sides:
            prefill(side, warm)
        prefill(offload_side, warm + fill(sizes.host_blocks))
        assert all(b.key is not None for b in offload_side.mgr.blocks if b.tier == 1), "host tier not full"

        for rep in range(sizes.warmup_reps + sizes.reps):
            timed = rep >= sizes.warmup_reps
            prompts = stream.take(sizes.requests_per_rep)
            new = stream.take(sizes.requests_per_rep)
            sides = [OursSide(sizes)] + ([VllmSide(vp, sizes)] if vp else [])
            watches = {s.name: {op: watch(s.name, op, timed) for op in ("alloc_store", "lookup", "free")}
                       for s in sides}
            gc.collect()
            got = run_alloc_lookup_free(sides, prompts, watches)
            del sides, watches
            gc.collect()
            sides = [OursSide(sizes, two_windows=True)] + ([VllmSide(vp, sizes, two_windows=True)] if vp else [])
            watches = {s.name: {op: watch(s.name, op + "_2w", timed) for op in ("alloc_store", "lookup", "free")}
                       for s in sides}
            got.update({op + "_2w": by_side for op, by_side in run_alloc_lookup_free(sides, prompts, watches).items()})
            del sides, watches
            gc.collect()
            got["evict"] = dict(zip((s.name for s in evict_sides),
                                    run_evict(evict_sides, new, [watch(s.name, "evict", timed) for s in evict_sides])))
            gc.collect()
            got["evict_offload"] = {"ours": run_evict([offload_side], new, [watch("ours", "evict_offload", timed)])[0]}
            if timed:
                for op, by_side in got.items():
                    for name, s in by_side.items():
                        samples[op][name].append(s)
    finally:
        if gc_was_enabled:
            gc.enable()
    samples["evict_offload"]["vLLM"] = samples["evict"]["vLLM"]
    return samples


def median_us(samples: list[Sample]) -> float | None:
    return statistics.median(s.us_per_block for s in samples) if samples else None


def _spread(samples: list[Sample]) -> str:
    if not samples:
        return "-"
    us = [s.us_per_block for s in samples]
    return f"{min(us):.2f}-{max(us):.2f}"


def print_table(sizes: BenchSizes, samples: dict[str, dict[str, list[Sample]]], peer_note: str,
                clock_name: str) -> dict[str, float]:
    """The table; returns ours/vLLM per operation (where both ran)."""
    ratios = {}
    head = (f"{'operation':<30}{'ours us/blk':>12}{'vLLM us/blk':>13}{'ours/vLLM':>11}   "
            f"{'ours min-max':>14}  {'vLLM min-max':>14}")
    print(head)
    print("-" * len(head))
    for op, label in ROWS:
        ours, theirs = samples[op]["ours"], samples[op]["vLLM"]
        mo, mv = median_us(ours), median_us(theirs)
        if mv is not None:  # paired: both sides ran the same prompts in turns within one repetition
            ratios[op] = statistics.median(a.us_per_block / b.us_per_block for a, b in zip(ours, theirs))
        tag = " *" if op == "evict_offload" and mv is not None else ""
        print(f"{label:<30}{mo:>12.2f}{'-' if mv is None else f'{mv:.2f}':>13}"
              f"{f'{ratios[op]:.2f}' if op in ratios else '-':>11}   {_spread(ours):>14}  {_spread(theirs):>14}{tag}")
    print()
    ev = {op: {side: sum(s.evicted for s in ss) / max(1, sum(s.blocks for s in ss)) for side, ss in d.items() if ss}
          for op, d in samples.items() if op.startswith("evict")}
    print(f"blocks: {sizes.tokens_per_block} tokens; pool {sizes.pool_blocks} device blocks (+{sizes.host_blocks} "
          f"host blocks for ours in row 5); prompts {sizes.min_prompt_blocks}-{sizes.max_prompt_blocks} full blocks + "
          f"1 partial; {sizes.requests_per_rep} prompts x {sizes.reps} reps (+{sizes.warmup_reps} warm-up), median "
          f"of per-rep us ({clock_name}) per block; ours/vLLM is the median of per-rep ratios")
    print("events ON on both sides, drained with take_events inside every timed region; the sides take turns "
          "prompt by prompt; GC off while timing, collected between reps")
    print("ours: metadata-only ledger (materialize=False, no tensors); keys + blake2b/msgpack hashes inside "
          "add_sequence/store")
    print("vLLM: Request creation with its sha256 block hashes is inside the timed region of rows 1, 2, 4, 5")
    print("per block = per block of the prompt (full blocks + the partial one) admitted, or freed in rows 3 and 8 "
          f"(rows 6-8: a position's block in each of the two windows; sliding window {WINDOW} tokens)")
    print("rows 3, 8: the finished request's state is dropped inside the timed region on both sides "
          "(ours: the ledger's sequence; vLLM: its Request with its token ids and block hashes)")
    print("rows 4-5: blocks evicted (device tier) per block allocated: "
          + "; ".join(f"{op} " + ", ".join(f"{k} {v:.1%}" for k, v in d.items()) for op, d in ev.items()))
    if "evict_offload" in ratios:
        print("* vLLM's BlockPool has no host tier: row 5 compares our offloading eviction against vLLM's plain "
              "eviction (its row 4 numbers)")
    print(peer_note)
    return ratios


def print_profiles(profiles: dict[str, cProfile.Profile], top: int) -> None:
    for op, prof in profiles.items():
        label = dict(ROWS)[op]
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.strip_dirs().sort_stats("tottime").print_stats(top)
        print(f"\n===== cProfile of ours, {label} (timed regions only), top {top} by tottime =====")
        text = buf.getvalue()
        print(text[text.find("   ncalls"):].rstrip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (small pool, few prompts, 3 reps)")
    ap.add_argument("--profile", action="store_true",
                    help="then cProfile our side for every operation where ours/vLLM > 1")
    ap.add_argument("--profile-all", action="store_true", help="cProfile our side for every operation")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with this thread's CPU time instead of wall time (for a busy shared machine)")
    ap.add_argument("--top", type=int, default=15, help="functions shown per profile")
    for f in dataclasses.fields(BenchSizes):
        ap.add_argument("--" + f.name.replace("_", "-"), type=int, default=None, help=f"override {f.name}")
    args = ap.parse_args(argv)
    sizes = QUICK if args.quick else BenchSizes()
    over = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchSizes) if getattr(args, f.name) is not None}
    sizes = dataclasses.replace(sizes, **over)

    t0 = time.monotonic()
    vp, why = load_peer()
    peer_note = (f"peer: vLLM {vp.version} BlockPool (real source from its PyPI wheel)" if vp
                 else f"peer: vLLM BlockPool could NOT be loaded ({why}); only our numbers are shown")
    clock = time.thread_time_ns if args.cpu_time else time.perf_counter_ns
    samples = run(sizes, vp, clock=clock)
    ratios = print_table(sizes, samples, peer_note, "thread CPU time" if args.cpu_time else "wall time")
    if args.profile_all or (args.profile and not ratios):  # no peer: nothing to compare, profile everything
        todo = [op for op, _ in ROWS]
    else:
        todo = [op for op, r in ratios.items() if r > 1.0] if args.profile else []
    if todo:
        profiles = {op: cProfile.Profile() for op in todo}
        run(dataclasses.replace(sizes, reps=max(1, sizes.reps // 3)), vp, profiles, clock)
        print_profiles(profiles, args.top)
    print(f"\ntotal wall time {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
