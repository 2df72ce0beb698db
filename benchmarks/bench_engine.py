"""Time to first token with a cached prefix vs with nothing cached (the baseline), on the reference engine.

One request at a time: a 2,048-token prompt whose first 1,536 tokens are cached
(a shared prefix, fresh suffix each round) against a 2,048-token prompt with a
fresh prefix each round, so nothing is reused. The two are measured alternately
in one run so drift hits both. TTFT is ``ReferenceEngine.serve`` with
``max_new_tokens=1``: admission (hashing, matching, allocation), the prefill
forward and the first token, then storing and release.

    python benchmarks/bench_engine.py [--rounds 5] [--prompt 2048] [--cached 1536] [--device auto] [--threads 1]

One CPU thread by default: on a shared machine oversubscribed intra-op threads
made the medians swing tenfold between runs; ``--threads 0`` keeps torch's default.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.ledger import CacheConfig, KVCacheManager, Request
from kvledger.worker.rank.batch import BatchDriver

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(slots=True)
class Sample:
    seconds: float
    cached_tokens: int
    computed_tokens: int


def run_once(engine: ReferenceEngine, mgr: KVCacheManager, rid: int, tokens: list[int]) -> Sample:
    t0 = time.perf_counter()
    (res,) = BatchDriver(engine).serve(mgr, [Request(request_id=rid, tokens=tokens, max_new_tokens=1)])
    return Sample(time.perf_counter() - t0, res.cached_tokens, res.computed_tokens)


def summary(name: str, samples: list[Sample]) -> float:
    ms = [s.seconds * 1e3 for s in samples]
    med = statistics.median(ms)
    computed = samples[0].computed_tokens
    prompt = computed + samples[0].cached_tokens
    print(f"{name:>9}: median {med:8.2f} ms  (min {min(ms):.2f}, max {max(ms):.2f})  "
          f"cached {samples[0].cached_tokens:>5}  computed {computed:>5}  "
          f"prefill {computed / (med / 1e3):>10,.0f} computed tok/s  {prompt / (med / 1e3):>10,.0f} prompt tok/s")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt length in tokens")
    ap.add_argument("--cached", type=int, default=1536, help="leading tokens cached (a multiple of the block size)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    ap.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op CPU threads; 0 keeps torch's default")
    args = ap.parse_args()
    if args.rounds < 1 or not 0 < args.cached < args.prompt or args.cached % args.tokens_per_block:
        ap.error("need rounds >= 1 and 0 < cached < prompt, cached a multiple of --tokens-per-block")
    if args.threads < 0:
        ap.error("--threads must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)

    blocks_per_round = -(-args.prompt // args.tokens_per_block)
    cfg = CacheConfig(tokens_per_block=args.tokens_per_block, dtype=DTYPES[args.dtype], device=args.device,
                      num_primary_blocks=(2 * args.rounds + 4) * blocks_per_round)
    engine, mgr = ReferenceEngine(cfg, seed=args.seed), KVCacheManager(cfg)
    rng = random.Random(args.seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    prefix = fresh(args.cached)
    ids = iter(range(1_000_000))
    run_once(engine, mgr, next(ids), prefix + fresh(args.prompt - args.cached))  # caches the prefix, warms up
    run_once(engine, mgr, next(ids), fresh(args.prompt))

    cached: list[Sample] = []
    uncached: list[Sample] = []
    for _ in range(args.rounds):
        cached.append(run_once(engine, mgr, next(ids), prefix + fresh(args.prompt - args.cached)))
        uncached.append(run_once(engine, mgr, next(ids), fresh(args.prompt)))
    assert all(s.cached_tokens == args.cached for s in cached), [s.cached_tokens for s in cached]
    assert all(s.cached_tokens == 0 for s in uncached), [s.cached_tokens for s in uncached]

    device = mgr.pools.device
    print(f"reference engine TTFT, {args.prompt}-token prompt, {args.rounds} rounds each, alternating; "
          f"device {device}, {torch.get_num_threads()} CPU thread(s), pool {args.dtype}, "
          f"{args.tokens_per_block} tokens/block, "
          f"{cfg.num_layers} layers, {cfg.num_kv_heads} kv heads x {cfg.head_dim}")
    med_cached = summary("cached", cached)
    med_uncached = summary("uncached", uncached)
    print(f"ratio cached/uncached TTFT: {med_cached / med_uncached:.3f}  "
          f"(speed-up {med_uncached / med_cached:.2f}x; compute share {1 - args.cached / args.prompt:.3f})")


if __name__ == "__main__":
    main()
