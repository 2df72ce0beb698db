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
- ``router``: the router actor is SIGKILLed mid-load; Ray restarts it on its port;
- ``mid_prefill``: a rank is armed to crash (``worker.rank.faults.CrashPoints``)
  after its next step wrote part of its running prompts' KV, before the
  requests finish;
- ``mid_publish``: a rank is armed to crash once it has numbered its next event
  batch and kept it for replay, before the batch leaves;
- ``migration_source`` / ``migration_target``: mid-load, a prompt is served on
  one rank and migrated to the other while the source (blocks pinned, mid-send)
  or the target (blocks allocated, mid-receive) is armed to crash; the
  migration must fail with a clear error, the survivor's side undone;
- ``overload``: the requests arrive at once from ``--burst-threads`` threads,
  more than the router admits (``--max-inflight`` on the ranks, ``--max-queued``
  waiting): the rest are shed with 429 and ``Retry-After``, and sent again.

After each phase the traffic stops and the run waits for quiescence, then
reports: requests sent, answered, lost (no answer after every attempt: goal
0), retried, shed (429); the index probe against every rank's exact probe on a
sample of prompts (divergent prompts: goal 0); ``check_integrity`` on every rank
(violations: goal 0); device blocks still in use on a rank once every request
finished (blocks leaked, by an interrupted migration above all: goal 0); and
the seconds from the fault to the first answer to a request sent after it
(time to service). A crash phase heals the cluster (Ray restarts the rank, the
group re-forms) before quiescence.

    python benchmarks/chaos.py [--requests 200] [--threads 8] [--burst-threads 64] [--seed 0]
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

from kvledger.coordinator.ray_env import configure, init_ray

configure()   # this script starts Ray: its environment first, before the imports below bring ray in
from kvledger.coordinator.cluster import Cluster  # noqa: E402
from kvledger.coordinator.config import ClusterConfig  # noqa: E402
from kvledger.coordinator.router_actor import RouterActorConfig, start_router  # noqa: E402
from kvledger.router.config import RouterConfig  # noqa: E402
from kvledger.router.rank_client import RankDiedError  # noqa: E402
from kvledger.worker.engine.tokenizer import encode  # noqa: E402
from kvledger.worker.ledger import CacheConfig  # noqa: E402
from kvledger.worker.rank.faults import TransportFaults  # noqa: E402
from kvledger.worker.wire.request import Request  # noqa: E402

T = 16
SYSTEMS = [f"System prompt {i}: you answer questions about caches, tersely and correctly. " * 3 for i in range(6)]
TIMEOUT_S = 120.0
GROUP_TIMEOUT_S = 20.0
"""The process group's timeout: how long a migration's survivor waits on a peer that crashed, at most."""


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
            fault: Callable[[], None] | None, fault_after: int, gap_s: float = 0.01) -> float | None:
    """Send ``n`` requests from ``threads`` threads, ``gap_s`` apart (0: one burst); run ``fault`` once
    ``fault_after`` were sent; its time."""
    prompts = [rng.choice(SYSTEMS) + f"Q{i}: what is block {rng.randrange(1000)}?" for i in range(n)]
    fault_at = None
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client, ThreadPoolExecutor(threads) as pool:
        futures = []
        for i, p in enumerate(prompts):
            futures.append(pool.submit(one_request, client, p, tally, attempts))
            if fault is not None and i == fault_after:
                fault_at = time.monotonic()
                fault()
            time.sleep(gap_s)   # a steady arrival rate, or with 0 one burst
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


def leaked_blocks(cluster: Cluster) -> int:
    """Device blocks still in use once every request finished: what a pin or an import left behind holds."""
    return sum(load.device_blocks_used for load in cluster.health() if load is not None and load.ready)


class MigrationUnderCrash:
    """The fault of a migration phase: serve a fresh prompt on ``src``, arm ``victim``'s crash at ``point``, then
    migrate the prompt to the other rank in a thread of its own (a survivor waits for its broken channel, at most
    the group's timeout, while the traffic goes on); ``outcome`` says how the migration ended."""

    def __init__(self, cluster: Cluster, point: str, src: int, seed: int) -> None:
        self.cluster, self.point, self.src = cluster, point, src
        self.victim = src if point == "migration_source" else 1 - src
        self.tokens = encode(f"Chaos {seed}: a prompt migrated while the {point} crashes. " * 4)
        self.outcome = "not run"
        self._thread: threading.Thread | None = None

    def __call__(self) -> None:
        self.cluster.client(self.src).serve([Request(10**9 + len(self.point), self.tokens)])
        self.cluster.arm_crash(self.victim, self.point)
        self._thread = threading.Thread(target=self._migrate, name="chaos-migration")
        self._thread.start()

    def _migrate(self) -> None:
        try:
            m = self.cluster.migrator.migrate(self.tokens, src=self.src, dst=1 - self.src)
            self.outcome = f"moved {m.sent_blocks} blocks (the crash did not fire)"
        except Exception as e:  # the report says how it failed; a clear error is the goal
            self.outcome = f"failed: {type(e).__name__}: {e}"

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                self.outcome = f"still running after {timeout_s:g} s (a hang)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per phase")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--burst-threads", type=int, default=64, help="client threads of the overload phase")
    ap.add_argument("--max-inflight", type=int, default=16, help="completions the router keeps on the ranks")
    ap.add_argument("--max-queued", type=int, default=16, help="completions the router queues beyond those")
    ap.add_argument("--attempts", type=int, default=8, help="attempts a client makes per request")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import ray

    rng = random.Random(args.seed)
    init_ray(num_cpus=max(os.cpu_count() or 1, 2), log_to_driver=False)
    cache = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                        device="cpu", num_primary_blocks=256, num_secondary_blocks=64)
    cluster = Cluster.start(ClusterConfig(num_ranks=2, device="cpu", cache=cache, num_cpus_per_rank=0.5,
                                          name_prefix="kvledger-chaos", call_timeout_s=TIMEOUT_S, max_restarts=-1,
                                          group_timeout_s=GROUP_TIMEOUT_S))
    faults = TransportFaults(drop=0.1, duplicate=0.1, reorder=0.1, delay=0.1, delay_s=0.02, seed=args.seed)
    bounds = RouterConfig(max_inflight_completions=args.max_inflight, max_queued_completions=args.max_queued)
    handle, url = start_router(cluster, RouterActorConfig(port=0, transport_faults=faults, health_interval_s=0.5,
                                                          router=bounds), name="kvledger-chaos-router")
    rows = []
    try:
        def kill_rank() -> None:
            r = rng.randrange(2)
            ray.kill(cluster.actors[r], no_restart=False)

        def kill_router() -> None:
            os.kill(ray.get(handle.pid.remote(), timeout=30), signal.SIGKILL)

        def crash_at(point: str) -> Callable[[], None]:
            def arm() -> None:
                try:
                    cluster.arm_crash(rng.randrange(2), point)
                except RankDiedError:
                    pass   # a busy rank can reach the point and crash before the call that armed it answers
            return arm

        migrations = {point: MigrationUnderCrash(cluster, point, rng.randrange(2), args.seed)
                      for point in ("migration_source", "migration_target")}
        crashes = ("rank", "mid_prefill", "mid_publish", *migrations)
        phases = [("transport", None), ("rank", kill_rank), ("router", kill_router),
                  ("mid_prefill", crash_at("mid_prefill")), ("mid_publish", crash_at("mid_publish")),
                  *migrations.items(), ("overload", None)]
        for name, fault in phases:
            tally = Tally()
            burst = name == "overload"
            fault_at = traffic(url, args.requests, args.burst_threads if burst else args.threads, args.attempts, rng,
                               tally, fault, args.requests // 3, gap_s=0.0 if burst else 0.01)
            if name in migrations:
                migrations[name].join(GROUP_TIMEOUT_S + 60)
            if name in crashes:
                cluster.heal(timeout_s=TIMEOUT_S)
            quiesce(url)
            # to service: from the fault to the first answer to a request sent after it
            after = [done for sent, done in tally.answers if fault_at is not None and sent > fault_at]
            rows.append((name, tally, divergence(url, rng), integrity_violations(cluster), leaked_blocks(cluster),
                         None if not after else min(after) - fault_at))
    finally:
        ray.kill(handle, no_restart=True)
        cluster.shutdown()
        ray.shutdown()
    print(f"{'fault':<16} {'sent':>5} {'answered':>8} {'lost':>5} {'retried':>7} {'shed':>5} {'divergent':>9} "
          f"{'integrity':>9} {'leaked':>6} {'to service s':>12}")
    for name, t, div, bad, leaked, back in rows:
        print(f"{name:<16} {t.sent:>5} {t.answered:>8} {t.lost:>5} {t.retried:>7} {t.shed:>5} {div:>9} {bad:>9} "
              f"{leaked:>6} {'-' if back is None else f'{back:.2f}':>12}")
    for point, m in migrations.items():
        print(f"{point}: migration {m.src} -> {1 - m.src}, rank {m.victim} armed to crash: {m.outcome}")
    print(f"overload: {args.burst_threads} clients at once, the router admitting {args.max_inflight} on the ranks "
          f"and queueing {args.max_queued}")
    print("goals: lost 0, divergent 0 (index probe vs every rank's exact probe, 30 prompts), integrity 0, leaked 0; "
          "each migration under a crash fails with RankDiedError naming the crashed rank")


if __name__ == "__main__":
    main()
