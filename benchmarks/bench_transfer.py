"""KV transfer speed: tier copies (offload/onboard) and migrations between ranks, each against its baseline.

(a) Offload and onboard of N blocks between the device and host tiers, driven
    through the ledger (``KVCacheManager`` admissions that evict to, and
    onboard from, the host tier), against one plain ``copy_`` of a contiguous
    tensor of the same bytes, in the same run. Goal: "with the books" (the whole
    admission: allocation, tree, events and copies) >= 0.8 of it; the ratio of
    the tier copies alone (the pools' ``flush``, where planned copies run) is
    printed beside it, and the books' own time (with the books minus the tier
    copy) per block the admission takes; first, the books of a 1-block
    admission under the same cold caches: the part of them that does not grow
    with the blocks. The KV bytes both sides copy are cold (128 MiB streamed
    through the caches first); the books are not, since a scheduler asks
    ``could_hold`` of the request before admitting it, which walks the same
    tree and free lists. Each ledger run is timed next to its plain copies, so
    that a pair shares the machine's state, and the goal's ratio is the median
    of the pairs' ratios.
(b) Migration of N blocks from rank 0 to rank 1 (two rank actors on a local
    Ray, gloo on CPUs, NCCL on GPUs): ``Migrator.migrate`` end to end (one call
    per side launched together: the pin, the source's slots, the allocation,
    the target's answer with its own slots, the pieces cut alike on both sides
    and moved from pool to pool, the target storing the blocks, which it does
    while its reply travels, its books locked until then), against one
    ``send``/``recv`` of a contiguous tensor of the same bytes between the same
    two actors (rank workers with a raw send and receive added,
    ``RawTransferWorker`` below), dispatched the same way, in the same run.
    Goal: end to end >= 0.8 of it; the move alone (the target's time from its
    receives posted to its last piece in) is printed beside it, and each rank's
    transfer counts (pieces, copies) after the runs.

    python benchmarks/bench_transfer.py [--blocks 64 512] [--reps 5] [--device auto] [--skip-tiers]
        [--skip-migration]

Block geometry: 16 tokens x 8 layers x 4 KV heads x 64 dims, float16 (128 KiB
a block). The source blocks' contents are written directly (not computed by the
engine): only their bytes matter here.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvledger.coordinator.ray_env import configure
from kvledger.worker.ledger import CacheConfig, KVCacheManager, Request, RetentionConfig, TokenRange
from kvledger.worker.rank.worker import RankWorker

T = 16
GEOMETRY = dict(tokens_per_block=T, num_layers=8, num_kv_heads=4, head_dim=64, dtype=torch.float16)


GOAL = 0.8   # tier copies with the books, and migrations end to end: at least this of the plain baseline


def _verdict(ratio: float) -> str:
    return f"{ratio:.2f} (goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})"


def cache_config(device: str, primary: int, secondary: int) -> CacheConfig:
    return CacheConfig(**GEOMETRY, device=device, num_primary_blocks=primary, num_secondary_blocks=secondary)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_SCRATCH = torch.empty(0)


def _cold_caches() -> None:
    """Stream 128 MiB through the CPU caches so neither side of a comparison starts with hot data, and collect
    the garbage so neither pays for a collection of what came before (the collector stays on while timing)."""
    global _SCRATCH
    gc.collect()
    if _SCRATCH.numel() == 0:
        _SCRATCH = torch.empty(64 << 20, dtype=torch.float16)
    _SCRATCH.fill_(2.0)


def plain_copy_seconds(nbytes: int, device: torch.device, to_host: bool) -> float:
    """One ``copy_`` of a contiguous tensor of ``nbytes`` between the tiers' memories (pre-touched, cold caches)."""
    from kvledger.worker.device import host_pin_memory
    n = nbytes // 2
    dev = torch.ones(n, dtype=torch.float16, device=device)
    host = torch.ones(n, dtype=torch.float16, pin_memory=host_pin_memory())
    src, dst = (dev, host) if to_host else (host, dev)
    _cold_caches()
    _sync(device)
    t0 = time.perf_counter()
    dst.copy_(src)
    _sync(device)
    return time.perf_counter() - t0


class _TimedFlush:
    """Wraps a pool's ``flush`` (where planned tier copies run) and adds up its time."""

    def __init__(self, pools) -> None:
        self.inner, self.seconds = pools.flush, 0.0
        self.device = pools.device
        pools.flush = self

    def __call__(self) -> None:
        t0 = time.perf_counter()
        self.inner()
        _sync(self.device)
        self.seconds += time.perf_counter() - t0


def _stored_ledger(n: int, device: str, materialize: bool) -> tuple[KVCacheManager, list[int]]:
    """A ledger of ``2n + 2`` device and ``n + 1`` host blocks holding ``n`` stored blocks (priority 35: offloaded,
    not dropped, when evicted), and their prompt; ``materialize=False``: the same books without tensors."""
    mgr = KVCacheManager(dataclasses.replace(cache_config(device, primary=2 * n + 2, secondary=n + 1),
                                             materialize=materialize))
    if materialize:
        mgr.pools.primary.fill_(1.0)  # touch every page before timing
        mgr.pools.secondary.fill_(1.0)
    keep = [t % 256 for t in range(n * T + 1)]
    mgr.add_sequence(Request(1, keep))
    mgr.store_context_blocks(1)
    mgr.remove_sequence(1)
    return mgr, keep


def tier_seconds(n: int, device: str, warm_books: bool) -> dict[str, float]:
    """Offload and onboard of ``n`` blocks through the ledger: copy time, ledger (books + copies) time, copies, and
    the blocks each admission takes (new, onboarded).

    The KV bytes are cold (``_cold_caches``) before each admission, and the scheduler's ``could_hold`` walks its
    request first. ``warm_books``: a twin ledger without tensors, in the same state, makes the same admission just
    before it, so the books' code runs warm, as in a scheduler that admitted a request the step before (the
    ledger's own victims and free lists stay cold); else only ``could_hold`` warms them."""
    mgr, keep = _stored_ledger(n, device, materialize=True)
    twin, _ = _stored_ledger(n, device, materialize=False) if warm_books else (None, keep)
    cheap = RetentionConfig(ranges=[TokenRange(0, None, priority=0)], decode_priority=0)
    filler = [256 + (i % 200) for i in range((2 * n + 2) * T)]
    dev = mgr.pools.device
    timer = _TimedFlush(mgr.pools)

    def admit(request: Callable[[], Request]) -> float:
        _cold_caches()
        if twin is not None:
            twin.could_hold(request())
            twin.add_sequence(request())
        r = request()
        mgr.could_hold(r)   # as a scheduler asks before admitting
        timer.seconds = 0.0
        t0 = time.perf_counter()
        mgr.add_sequence(r)
        _sync(dev)
        return time.perf_counter() - t0

    c0 = mgr.pools.copies_issued
    out = {"offload_ledger": admit(lambda: Request(2, filler, retention=cheap)),   # offloads the n stored blocks
           "offload_copy": timer.seconds, "offload_copies": mgr.pools.copies_issued - c0,
           "offload_blocks": 2 * n + 2, "onboard_blocks": n + 1}
    assert mgr.stats().offloaded_blocks == n, mgr.stats()
    for ledger in (mgr, twin) if twin is not None else (mgr,):
        ledger.remove_sequence(2)  # its blocks (priority 0) are dropped, not offloaded, when evicted
    c0 = mgr.pools.copies_issued
    out.update(onboard_ledger=admit(lambda: Request(3, keep)), onboard_copy=timer.seconds,   # onboards the n blocks
               onboard_copies=mgr.pools.copies_issued - c0)
    assert mgr.admission(3).onboarded_blocks == n, mgr.admission(3)
    mgr.remove_sequence(3)
    mgr.check_integrity()
    return out


def bench_tiers(blocks: list[int], reps: int, device: str) -> None:
    bpb = cache_config(device, 1, 0).bytes_per_block
    dev = KVCacheManager(cache_config(device, 1, 0)).pools.device
    print(f"(a) tier copies through the ledger, {bpb // 1024} KiB blocks, device {dev}, median of {reps}")
    for warm, how in ((False, "cold code: only could_hold warms the books"),
                      (True, "warm books: the scheduler's code ran the step before (the goal's condition)")):
        one = [tier_seconds(1, device, warm) for _ in range(reps)]
        print(f" {how}\n  books of a 1-block admission (what any admission pays before its blocks): "
              + ", ".join(f"{name} {statistics.median(r[f'{name}_ledger'] - r[f'{name}_copy'] for r in one) * 1e3:.2f}"
                          " ms" for name in ("offload", "onboard")))
        for n in blocks:
            _tier_point(n, bpb, dev, reps, device, warm)


def _tier_point(n: int, bpb: int, dev: torch.device, reps: int, device: str, warm: bool) -> None:
    nbytes = n * bpb
    runs: list[dict[str, float]] = []
    base: dict[str, list[float]] = {"offload": [], "onboard": []}
    for _ in range(reps):   # each ledger run beside its plain copies: the pair sees the machine in one state
        runs.append(tier_seconds(n, device, warm))
        base["offload"].append(plain_copy_seconds(nbytes, dev, to_host=True))
        base["onboard"].append(plain_copy_seconds(nbytes, dev, to_host=False))
    for name in ("offload", "onboard"):
        paired = statistics.median(b / r[f"{name}_ledger"] for b, r in zip(base[name], runs))
        base_gbs = nbytes / statistics.median(base[name]) / 1e9
        copy_s = statistics.median(r[f"{name}_copy"] for r in runs)
        ledger_s = statistics.median(r[f"{name}_ledger"] for r in runs)
        copy_gbs, ledger_gbs = nbytes / copy_s / 1e9, nbytes / ledger_s / 1e9
        print(f"  {name} {n:>4} blocks ({nbytes / 2**20:5.1f} MiB): tier copy {copy_gbs:6.2f} GB/s "
              f"({runs[0][f'{name}_copies']} slice copies), with the books {ledger_gbs:6.2f} GB/s; "
              f"plain copy_ {base_gbs:6.2f} GB/s; ratio {copy_gbs / base_gbs:.2f}")
        admitted = runs[0][f"{name}_blocks"]
        print(f"  books {name} {n:>4} blocks: {(ledger_s - copy_s) * 1e3:.2f} ms besides the tier copy, "
              f"{(ledger_s - copy_s) * 1e6 / admitted:.2f} us per block of the admission ({admitted} blocks)")
        verdict = _verdict(paired) if warm else f"{paired:.2f}"
        print(f"  {'goal ' if warm else ''} {name} {n:>4} blocks, tier copy with the books / plain copy_ "
              f"(median of the pairs): {verdict}")


class RawTransferWorker(RankWorker):
    """A rank worker that can also send and receive one plain tensor: the baseline a migration is measured
    against, between the same two actors over the same process group."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._scratch_buf: torch.Tensor | None = None

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


def _fill_prefix(rank, tokens: list[int], rid: int) -> int:
    """Run on a rank actor (``__ray_call__``): store ``tokens``' full blocks with written (not computed) KV."""
    with rank.books.lock:
        mgr = rank.manager
        mgr.add_sequence(Request(rid, tokens))
        slots = [mgr.blocks[b].slot for b in mgr.get_block_ids(rid)]
        mgr.pools.primary[slots] = 1.0
        mgr.store_context_blocks(rid)
        mgr.remove_sequence(rid)
        return len(slots)


def _clear(rank) -> None:
    with rank.books.lock:
        rank.manager.clear()
        rank.manager.take_events()


def bench_migration(blocks: list[int], reps: int, device: str) -> None:
    import ray

    from kvledger.coordinator.cluster import Cluster
    from kvledger.coordinator.config import ClusterConfig
    from kvledger.coordinator.ray_env import init_ray

    init_ray(num_cpus=2, log_to_driver=False)
    need = max(blocks) + 2
    bpb = cache_config("cpu", 1, 0).bytes_per_block
    cache = CacheConfig(**GEOMETRY, device="auto", primary_bytes=need * bpb, num_secondary_blocks=0)
    cluster = Cluster.start(ClusterConfig(num_ranks=2, device=device, cache=cache, num_cpus_per_rank=0.5,
                                          gpu_memory_fraction=None,
                                          call_timeout_s=300, group_timeout_s=120), RawTransferWorker)
    try:
        a, b = cluster.actors
        mig = cluster.migrator
        print(f"(b) migration rank 0 -> rank 1 ({cluster.device}, "
              f"{'nccl' if cluster.device == 'cuda' else 'gloo'}), {bpb // 1024} KiB blocks, median of {reps}")
        for n in blocks:
            tokens = [i % 256 for i in range(n * T + 1)]
            ray.get(a.__ray_call__.remote(_fill_prefix, tokens, 10**9), timeout=300)
            xfer, e2e, base = [], [], []
            for rep in range(reps + 1):  # the first round warms the pair's connection up
                ray.get(b.__ray_call__.remote(_clear), timeout=300)
                t0 = time.perf_counter()
                m = mig.migrate(tokens, src=0, dst=1)
                total = time.perf_counter() - t0
                assert m.sent_blocks == n and m.bytes == n * bpb, m
                t0 = time.perf_counter()
                refs = [a.send_tensor.remote(n * bpb // 2, 1), b.recv_tensor.remote(n * bpb // 2, 0)]
                ray.get(refs, timeout=300)
                plain = time.perf_counter() - t0
                if rep:
                    xfer.append(m.seconds)
                    e2e.append(total)
                    base.append(plain)
            nbytes = n * bpb
            gbs = nbytes / statistics.median(xfer) / 1e9
            e2e_gbs = nbytes / statistics.median(e2e) / 1e9
            base_gbs = nbytes / statistics.median(base) / 1e9
            print(f"  migrate {n:>4} blocks ({nbytes / 2**20:6.1f} MiB): {gbs:6.2f} GB/s "
                  f"(end to end {e2e_gbs:5.2f}); plain send/recv {base_gbs:6.2f} GB/s; "
                  f"ratio {gbs / base_gbs:.2f} (the move alone)")
            print(f"  goal  migrate {n:>4} blocks end to end / plain send/recv: {_verdict(e2e_gbs / base_gbs)}")
            ray.get(a.__ray_call__.remote(_clear), timeout=300)
        st = [c.info().transfers for c in cluster.clients]
        print(f"  transfers: rank 0 {st[0]}, rank 1 {st[1]}")
    finally:
        cluster.shutdown()
        ray.shutdown()


def main() -> None:
    configure()   # before the migration bench imports ray
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--skip-tiers", action="store_true")
    p.add_argument("--skip-migration", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in this process (0: default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_tiers:
        bench_tiers(args.blocks, args.reps, args.device)
    if not args.skip_migration:
        bench_migration(args.blocks, args.reps, args.device)


if __name__ == "__main__":
    main()
