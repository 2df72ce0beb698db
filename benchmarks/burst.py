"""A burst of concurrent completions over HTTP: continuous batching against one request at a time per rank.

Two rank actors and the router actor on a local Ray (127.0.0.1). All
``--requests`` completions (``--max-tokens`` tokens each, distinct prompts) are
sent at once, each on its own connection, and each answer's time since the
burst began is kept. Printed per run: time to the first answer, p50 and p99 of
the answers' latencies, requests shed (429), and goodput (answered requests
and generated tokens per second of the burst). Two runs in the same process,
side by side: ``batched`` (the ranks' defaults, ``max_num_seqs`` requests per
step) and the baseline ``one at a time`` (``max_num_seqs=1``: a rank serves one
request at a time, as it did before continuous batching); then the ratios.

    python benchmarks/burst.py [--requests 600] [--max-tokens 16]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from dataclasses import dataclass

import httpx
import numpy as np

from kvledger.coordinator.ray_env import configure, init_ray

configure()   # this script starts Ray: its environment first, before the imports below bring ray in
from kvledger.coordinator.cluster import Cluster  # noqa: E402
from kvledger.coordinator.config import ClusterConfig  # noqa: E402
from kvledger.coordinator.router_actor import RouterActorConfig, start_router  # noqa: E402

TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class BurstResult:
    name: str
    answered: int
    shed: int
    failed: int
    first_s: float
    p50_s: float
    p99_s: float
    wall_s: float
    tokens: int
    peak_running: int
    """Most requests a rank ran in one batch."""
    steps: int
    """Steps the ranks took, together."""

    @property
    def goodput_rps(self) -> float:
        return self.answered / self.wall_s

    @property
    def goodput_tps(self) -> float:
        return self.tokens / self.wall_s


async def burst(url: str, requests: int, max_tokens: int, name: str) -> BurstResult:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as client:
        for i in range(4):   # warm up: the ranks' first steps, the router's first routes
            (await client.post("/v1/completions", json={"prompt": f"warm-up {i}", "max_tokens": 2})).raise_for_status()
        t0 = time.monotonic()

        async def one(i: int) -> tuple[int, float, int]:
            body = {"prompt": f"Request {i}: tell me what a KV cache keeps.", "max_tokens": max_tokens}
            r = await client.post("/v1/completions", json=body)
            tokens = len(r.json()["kvledger"]["output_token_ids"]) if r.status_code == 200 else 0
            return r.status_code, time.monotonic() - t0, tokens

        got = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.monotonic() - t0
    lat = np.array([t for status, t, _ in got if status == 200])
    shed = sum(1 for status, _, _ in got if status == 429)
    p50, p99 = (float(x) for x in np.percentile(lat, [50, 99])) if lat.size else (float("nan"),) * 2
    return BurstResult(name, int(lat.size), shed, requests - int(lat.size) - shed,
                       float(lat.min()) if lat.size else float("nan"), p50, p99, wall,
                       sum(n for _, _, n in got), 0, 0)


def run_one(name: str, max_num_seqs: int, requests: int, max_tokens: int) -> BurstResult:
    """One burst on a cluster of its own (ranks with ``max_num_seqs``), with the ranks' batch figures."""
    import ray

    cfg = ClusterConfig(num_ranks=2, device="cpu", name_prefix=f"kvledger-burst-{max_num_seqs}",
                        max_num_seqs=max_num_seqs)
    cluster = Cluster.start(cfg)
    try:
        handle, url = start_router(cluster, RouterActorConfig(port=0), name=f"kvledger-burst-router-{max_num_seqs}")
        try:
            got = asyncio.run(burst(url, requests, max_tokens, name))
            loads = [c.load() for c in cluster.clients]
            return dataclasses.replace(got, peak_running=max(x.peak_running_requests for x in loads),
                                       steps=sum(x.steps for x in loads))
        finally:
            ray.kill(handle, no_restart=True)
    finally:
        cluster.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    init_ray(num_cpus=2, log_to_driver=False)
    batched = run_one("batched", ClusterConfig().max_num_seqs, args.requests, args.max_tokens)
    base = run_one("one at a time (max_num_seqs=1)", 1, args.requests, args.max_tokens)
    print(f"{args.requests} concurrent completions of {args.max_tokens} tokens, 2 CPU ranks, over HTTP")
    print(f"{'run':34} {'answered':>8} {'shed':>5} {'failed':>6} {'first':>8} {'p50':>8} {'p99':>8} "
          f"{'wall':>8} {'req/s':>8} {'tok/s':>8} {'batch':>6} {'steps':>6}")
    for r in (batched, base):
        print(f"{r.name:34} {r.answered:8d} {r.shed:5d} {r.failed:6d} {r.first_s:7.2f}s {r.p50_s:7.2f}s "
              f"{r.p99_s:7.2f}s {r.wall_s:7.2f}s {r.goodput_rps:8.1f} {r.goodput_tps:8.1f} {r.peak_running:6d} "
              f"{r.steps:6d}")
    print(f"baseline / batched: first answer {base.first_s / batched.first_s:.1f}x, "
          f"p50 {base.p50_s / batched.p50_s:.1f}x, p99 {base.p99_s / batched.p99_s:.1f}x; goodput batched / baseline "
          f"{batched.goodput_rps / base.goodput_rps:.1f}x")


if __name__ == "__main__":
    main()
