"""The chaos run: a real local cluster under steady traffic while faults are injected, then what was lost.

Two rank actors and the router actor on a local Ray (127.0.0.1). Client
threads send completions of prompts that share system prompts, as a client
library would: an answer is kept, a 429 or 503 is retried after its
``Retry-After``, a connection that fails (the router died under it) is retried
with an exponential backoff (0.25 s doubling, at most 8 s), each at most
``--attempts`` times. Faults, one phase each, in this order:

- ``transport``: the ranks' event pushes drop, duplicate, reorder and delay a
  seeded share of batches (``worker.rank.faults.TransportFaults``), all run long;
- ``rank``: a rank actor is SIGKILLed mid-load; Ray restarts it, the cluster
  heals (the process group re-forms);
- ``router``: the router actor is SIGKILLed mid-load; Ray restarts it on its port.

After each phase the traffic stops and the run waits for quiescence, then
reports: requests sent, answered, lost (no answer after every attempt: goal
0), retried, shed (429); the index probe against every rank's exact probe on a
sample of prompts (divergent prompts: goal 0); ``check_integrity`` on every rank
(violations: goal 0); and the seconds from the fault to the first answer to a
request sent after it (time to service).

    python benchmarks/chaos.py [--requests 200] [--threads 8] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import torch

import kvledger.coordinator  # noqa: F401  (before ray: loopback-only local Ray, one auth mode)
from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.ray_env import init_ray
from kvledger.coordinator.router_actor import RouterActorConfig, start_router
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.rank.faults import TransportFaults

T = 16
SYSTEMS = [f"System prompt {i}: you answer questions about caches, tersely and correctly. " * 3 for i in range(6)]
TIMEOUT_S = 120.0


@dataclass(slots=True)
class Tally:
    sent: int = 0
    answered: int = 0
    lost: int = 0
    retried: int = 0
    shed: int = 0
    answers: list[tuple[float, float]] = field(default_factory=list)
    """(first sent, answered) per answered request."""
    lock: threading.Lock = field(default_factory=threading.Lock)


def one_request(client: httpx.Client, prompt: str, tally: Tally, attempts: int) -> None:
    with tally.lock:
        tally.sent += 1
    first_sent = time.monotonic()
    for attempt in range(attempts):
        try:
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        except httpx.TransportError:
            r = None
        if r is not None and r.status_code == 200:
            with tally.lock:
                tally.answered += 1
                tally.answers.append((first_sent, time.monotonic()))
            return
        with tally.lock:
            tally.retried += 1
            tally.shed += r is not None and r.status_code == 429
        backoff = min(0.25 * 2 ** attempt, 8.0)
        wait = float(r.headers.get("retry-after", backoff)) if r is not None else backoff
        time.sleep(wait)   # what a client does with Retry-After, or, after a refused connection, backs off
    with tally.lock:
        tally.lost += 1


def traffic(url: str, n: int, threads: int, attempts: int, rng: random.Random, tally: Tally,
            fault: Callable[[], None] | None, fault_after: int) -> float | None:
    """Send ``n`` requests from ``threads`` threads; run ``fault`` once ``fault_after`` were sent; its time."""
    prompts = [rng.choice(SYSTEMS) + f"Q{i}: what is block {rng.randrange(1000)}?" for i in range(n)]
    fault_at = None
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client, ThreadPoolExecutor(threads) as pool:
        futures = []
        for i, p in enumerate(prompts):
            futures.append(pool.submit(one_request, client, p, tally, attempts))
            if fault is not None and i == fault_after:
                fault_at = time.monotonic()
                fault()
            time.sleep(0.01)   # a steady arrival rate, not one burst
        for f in futures:
            f.result(timeout=TIMEOUT_S * attempts)
    return fault_at


def quiesce(url: str, timeout_s: float = 60.0) -> None:
    """Until the router answers and every rank is live in it (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            h = httpx.get(f"{url}/health", timeout=5).json()
            if h.get("live_ranks") == [0, 1]:
                time.sleep(2.0)   # a health round or two: pushes in flight land, gaps get closed
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)   # the router restarts in another process: nothing to wait on here
    raise TimeoutError(f"the cluster did not quiesce within {timeout_s:g} s")


def divergence(url: str, rng: random.Random, samples: int = 30) -> int:
    """Prompts of a sample where the index's probe differs from the ranks' own."""
    bad = 0
    for i in range(samples):
        p = rng.choice(SYSTEMS) + f"Q{rng.randrange(10_000)}: probe"
        approx = httpx.post(f"{url}/v1/probe", json={"prompt": p}, timeout=30).json()["ranks"]
        exact = httpx.post(f"{url}/v1/probe", json={"prompt": p, "exact": True}, timeout=30).json()["ranks"]
        bad += [r["matched_tokens"] for r in approx] != [r["matched_tokens"] for r in exact]
    return bad


def integrity_violations(cluster: Cluster) -> int:
    bad = 0
    for c in cluster.clients:
        try:
            c.check_integrity()
        except Exception as e:  # the report counts it; a run never stops on one
            print(f"  rank {c.rank}: {e}")
            bad += 1
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per phase")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--attempts", type=int, default=8, help="attempts a client makes per request")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import ray  # after kvledger.coordinator set the Ray environment: every socket on 127.0.0.1

    rng = random.Random(args.seed)
    init_ray(num_cpus=max(os.cpu_count() or 1, 2), log_to_driver=False)
    cache = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                        device="cpu", num_primary_blocks=256, num_secondary_blocks=64)
    cluster = Cluster.start(ClusterConfig(num_ranks=2, device="cpu", cache=cache, num_cpus_per_rank=0.5,
                                          name_prefix="kvledger-chaos", call_timeout_s=TIMEOUT_S, max_restarts=-1))
    faults = TransportFaults(drop=0.1, duplicate=0.1, reorder=0.1, delay=0.1, delay_s=0.02, seed=args.seed)
    handle, url = start_router(cluster, RouterActorConfig(port=0, transport_faults=faults, health_interval_s=0.5),
                               name="kvledger-chaos-router")
    rows = []
    try:
        def kill_rank() -> None:
            r = rng.randrange(2)
            ray.kill(cluster.actors[r], no_restart=False)

        def kill_router() -> None:
            os.kill(ray.get(handle.pid.remote(), timeout=30), signal.SIGKILL)

        for name, fault in (("transport", None), ("rank", kill_rank), ("router", kill_router)):
            tally = Tally()
            fault_at = traffic(url, args.requests, args.threads, args.attempts, rng, tally, fault, args.requests // 3)
            if name == "rank":
                cluster.heal(timeout_s=TIMEOUT_S)
            quiesce(url)
            # to service: from the fault to the first answer to a request sent after it
            after = [done for sent, done in tally.answers if fault_at is not None and sent > fault_at]
            rows.append((name, tally, divergence(url, rng), integrity_violations(cluster),
                         None if not after else min(after) - fault_at))
    finally:
        ray.kill(handle, no_restart=True)
        cluster.shutdown()
        ray.shutdown()
    print(f"{'fault':<10} {'sent':>5} {'answered':>8} {'lost':>5} {'retried':>7} {'shed':>5} {'divergent':>9} "
          f"{'integrity':>9} {'to service s':>12}")
    for name, t, div, bad, back in rows:
        print(f"{name:<10} {t.sent:>5} {t.answered:>8} {t.lost:>5} {t.retried:>7} {t.shed:>5} {div:>9} {bad:>9} "
              f"{'-' if back is None else f'{back:.2f}':>12}")
    print("goals: lost 0, divergent 0 (index probe vs every rank's exact probe, 30 prompts), integrity 0")


if __name__ == "__main__":
    main()
