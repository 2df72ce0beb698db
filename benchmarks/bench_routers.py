"""kvledger's ``kv`` against SGLang's and vLLM's own routers, in front of the same real vLLM servers, caches full.

The routing issue's bench. N vLLM 0.32 CPU servers on the tiny checkpoint, each
with ``--num-gpu-blocks-override`` KV blocks of 32 tokens (so that together they
hold a workload's working set and one of them does not), OpenMP threads bound to
a core each (engine i on core i mod the machine's cores), ``--enable-scale-out``
(vllm-router tokenizes through the render endpoints it serves). Each workload of
``replay.workloads`` named (``docs`` by default; several run one after the other
on the same servers) goes, as text, through each router in turn, every one a
process of its own:

- ``kvledger``: the kvledger router with ``--policy kv`` (subscribed to the servers' ZMQ events);
- ``sglang-router``: ``cache_aware``;
- ``vllm-router``: ``kv_aware`` (fed the same ZMQ events), ``cache_aware`` and ``round_robin``.

The peer routers come from PyPI at the versions below, into a virtual
environment of their own (built on first use); they are never kvledger's
dependencies. Before each router the servers' prefix caches are reset. Every
figure comes from the engines: the hit rate and the requests per engine from the
deltas of their ``/metrics`` (``vllm:prefix_cache_hits_total`` over
``vllm:prompt_tokens_total``; each router's one-token warm-up completion is among
them), TTFT from the first streamed chunk. Beside each engine's requests, its
preemptions (its KV blocks ran out) and its first tokens over a second by its own
clock (``vllm:time_to_first_token_seconds``): a stall the engine saw, where the
client's TTFT alone cannot tell an engine's stall from a router's.

``--slow`` runs each router a second time with engine 0 slowed by another
tenant's long decodes sent to it directly (``--slow-streams`` at once), which the
routers must learn from the engine's answers and metrics; that tenant's own
prompt and cached tokens (from its answers) are taken out of engine 0's figures.

The offline bound is the best static split of the workload's prefixes over the
engines: each prefix (a request's first block) pinned to one engine, each engine
an LRU of its blocks, the best hit rate over greedy placements (by traffic, by
size) of the prefixes onto the engines' capacities.

    python benchmarks/bench_routers.py [--engines 2] [--blocks 200] [--workload docs[,conversation,...]] [--slow]
        [--rounds 1] [--vllm URL ...] [--kv-speed-spread 4 ...]

``--rounds N`` runs every router N times, the routers one after the other in each round, and prints each round's
table, the medians over the rounds (with the lowest and highest) and the goals paired within each round, with how
many rounds met each: on this shared 2-core machine one run is one sample (its p90 moves 2-3x between runs).
``--kv-<field>`` sets a field of ``kv``'s cost model for the kvledger router, as ``kvledger up`` takes it.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO / "tests"))   # the real vLLM harness the suite uses
from vllm_engines import VllmServer, start_bench_servers  # noqa: E402

from kvledger.launch.policy_flags import add_policy_flags  # noqa: E402
from kvledger.replay.bounds import static_split_cached_tokens  # noqa: E402
from kvledger.replay.engine_totals import SLOW_FIRST_TOKEN_S, EngineTotals  # noqa: E402
from kvledger.replay.peers import Peer, PeerRouter, RouterProcess, event_endpoints  # noqa: E402
from kvledger.replay.text_prompts import prompt_text  # noqa: E402
from kvledger.replay.trace import Trace  # noqa: E402
from kvledger.replay.workloads import WORKLOADS, WorkloadConfig, workload  # noqa: E402

BLOCK = 32
HTTP_TIMEOUT_S = 120.0
#: The routers, in the order they run: the router, then its policy.
ROUTERS = ("kvledger kv", "sglang-router cache_aware", "vllm-router kv_aware", "vllm-router cache_aware",
           "vllm-router round_robin")


# ---------------------------------------------------------------------------------------------- the workload

def prompt_of(r) -> str:   # type: ignore[no-untyped-def]
    """A request's text: ``BLOCK`` characters per trace block (``replay.text_prompts``), which the tiny checkpoint's
    byte tokenizer makes ``<s>`` and one token per character, so prompts share whole blocks where their ids agree."""
    return prompt_text(r.hash_ids, r.input_length, BLOCK)


def offline_bound(trace: Trace, capacities: list[int]) -> float:
    """The best static split's hit rate (``replay.bounds.static_split_cached_tokens``) over the prompt tokens, each
    with its ``<s>``."""
    cached = static_split_cached_tokens([r.hash_ids for r in trace.requests], [r.input_length for r in trace.requests],
                                        BLOCK, capacities)
    return cached / sum(r.input_length + 1 for r in trace.requests)


# ---------------------------------------------------------------------------------------------- engines

def start_servers(work: Path, count: int, blocks: int) -> list[VllmServer]:
    """``count`` servers, engine i bound to core i mod the machine's cores (two on a core share it, bound)."""
    cpus = sorted(os.sched_getaffinity(0))
    return start_bench_servers(work, [str(cpus[i % len(cpus)]) for i in range(count)],
                               ("--num-gpu-blocks-override", str(blocks), "--enable-scale-out"), BLOCK)


# ---------------------------------------------------------------------------------------------- routers

def serve_kvledger(spec: dict) -> None:
    """The kvledger router alone, in this process (``--serve-router``): its port on stdout, serving until stdin
    closes."""
    from kvledger.router.array_index import warm_kernels
    from kvledger.router.config import RouterConfig
    from kvledger.router.http import HttpServer, make_app
    from kvledger.router.service import RouterService

    warm_kernels()   # as ``kvledger up``'s router does before it reports ready
    split = {"vllm_prefill": tuple(spec["prefill"]), "split_mode": spec["split_mode"],
             "min_split_tokens": spec["min_split_tokens"]} if spec.get("prefill") else {}
    service = RouterService(None, RouterConfig(tokens_per_block=BLOCK, policy=spec["policy"],
                                               policy_options=spec.get("options", {}), vllm=tuple(spec["urls"]),
                                               **split))
    service.refresh_loads(force=True)
    stop = threading.Event()

    def maintain() -> None:   # what the router actor of ``kvledger up`` does every health interval
        while not stop.wait(1.0):
            service.check_health()
            service.refresh_loads(force=True)

    threading.Thread(target=maintain, daemon=True).start()
    server = HttpServer(make_app(service), port=0).start()
    print(server.port, flush=True)
    sys.stdin.read()
    stop.set()
    server.stop()
    service.close()


class KvledgerRouter(RouterProcess):
    """kvledger's router in a process of its own (``--serve-router``), as the peers run; it stops when its stdin
    closes."""

    stdin_grace_s = 10.0

    def __init__(self, policy: str, servers: list[str], model: str, split: dict | None = None,
                 options: dict | None = None) -> None:
        """``split``: ``prefill`` (the servers that only prefill), ``split_mode`` and ``min_split_tokens``;
        ``options``: the policy's config fields (``RouterConfig.policy_options``)."""
        spec = {"policy": policy, "urls": servers, "options": options or {}, **(split or {})}
        cmd = [sys.executable, __file__, "--serve-router", json.dumps(spec)]
        super().__init__(f"kvledger {policy}", cmd, model, None)


def start_router(name: str, servers: list[str], events: list[str], model: str,
                 options: dict | None = None) -> KvledgerRouter | PeerRouter:
    """``options``: the kvledger policy's config fields (``--kv-backlog-weight 6`` and so on)."""
    kind, policy = name.split()
    if kind == "kvledger":
        return KvledgerRouter(policy, servers, model, options=options)
    return PeerRouter(Peer(kind, policy), servers, events, model, BLOCK)


# ---------------------------------------------------------------------------------------------- one run

@dataclass
class RunResult:
    router: str
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    """Seconds between a stream's successive chunks, over every request."""
    failed: int = 0
    counts: list[EngineTotals] = field(default_factory=list)
    wall_s: float = 0.0
    learned: str = ""
    """kvledger's: the seconds per prompt token it learned of each engine (``GET /v1/cluster``)."""
    router_cpu_s: float = 0.0
    """The router's processes' CPU over the run (``RouterProcess.cpu_s``)."""

    def hit_rate(self) -> float:
        prompt = sum(c.prompt_tokens for c in self.counts)
        return sum(c.cached_tokens for c in self.counts) / prompt if prompt else 0.0

    def rate(self) -> float:
        """Completions per second over the run."""
        return len(self.ttft) / self.wall_s if self.wall_s else 0.0


class Background:
    """Another tenant's long decodes sent straight to one engine, ``streams`` at once, until stopped."""

    def __init__(self, url: str, model: str, streams: int, seed: int) -> None:
        self.url, self.model, self.stop_ = url, model, threading.Event()
        self.prompt = self.cached = self.requests = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(seed * 100 + i,), daemon=True)
                        for i in range(streams)]
        for t in self.threads:
            t.start()

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as c:
            while not self.stop_.is_set():   # bounded: stopped after the run
                text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(40))
                r = c.post(f"{self.url}/v1/completions", json={"model": self.model, "prompt": text,
                                                               "max_tokens": 256, "ignore_eos": True})
                u = r.json().get("usage") or {}
                with self._lock:
                    self.requests += r.status_code == 200
                    self.prompt += int(u.get("prompt_tokens") or 0)
                    self.cached += int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def close(self) -> None:
        self.stop_.set()
        for t in self.threads:
            t.join(timeout=HTTP_TIMEOUT_S)


def replay(router: RouterProcess, trace: Trace, model: str,
           concurrency: int) -> tuple[list[float], list[float], int]:
    """The trace through ``router`` at its arrival times, at most ``concurrency`` at once: TTFTs, the gaps between
    each stream's chunks, failures."""
    ttft: list[float] = []
    itl: list[float] = []
    failed = 0
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(i: int, client: httpx.Client) -> None:
        nonlocal failed
        r = trace.requests[i]
        body = {"model": model, "prompt": prompt_of(r), "max_tokens": r.output_length,
                "stream": True, "ignore_eos": True}
        start = time.perf_counter()
        try:
            with client.stream("POST", f"{router.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}")
                times = [time.perf_counter() - start for line in resp.iter_lines()
                         if line.startswith("data: ") and line != "data: [DONE]"]
            with lock:
                ttft.append(times[0] if times else float("nan"))
                itl.extend(b - a for a, b in itertools.pairwise(times))
        except Exception:  # a failed request is counted, never fatal to the run
            with lock:
                failed += 1

    with httpx.Client(timeout=HTTP_TIMEOUT_S, limits=httpx.Limits(max_connections=concurrency)) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        futures = []
        for i, r in enumerate(trace.requests):   # bounded: one pass
            wait = r.timestamp_s - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            futures.append(pool.submit(one, i, client))
        for f in futures:
            f.result(timeout=HTTP_TIMEOUT_S * 2)
    return ttft, itl, failed


def run(name: str, urls: list[str], events: list[str], model: str, trace: Trace, concurrency: int,
        slow_streams: int, options: dict | None = None) -> RunResult:
    with httpx.Client(timeout=30.0) as c:
        for url in urls:
            c.post(f"{url}/reset_prefix_cache").raise_for_status()
        before = [EngineTotals.read(c, u) for u in urls]
    router = start_router(name, urls, events, model, options)
    background = Background(urls[0], model, slow_streams, 1) if slow_streams else None
    try:
        if background is not None:
            time.sleep(1.0)   # the other tenant's decodes under way
        t0, cpu0 = time.perf_counter(), router.cpu_s()
        ttft, itl, failed = replay(router, trace, model, concurrency)
        wall, cpu = time.perf_counter() - t0, router.cpu_s() - cpu0
        learned = learned_rates(router.url) if isinstance(router, KvledgerRouter) else ""
    finally:
        if background is not None:
            background.close()
        router.close()
    time.sleep(0.5)   # the last counters in
    with httpx.Client(timeout=30.0) as c:
        counts = [EngineTotals.read(c, u).since(b) for u, b in zip(urls, before)]
    if background is not None:   # the other tenant's own requests, as they were answered
        counts[0] = counts[0].since(EngineTotals(background.prompt, background.cached, background.requests))
    return RunResult(name, ttft, itl, failed, counts, wall, learned, cpu)


def learned_rates(url: str) -> str:
    with httpx.Client(timeout=30.0) as c:
        ranks = c.get(f"{url}/v1/cluster").json()["ranks"]
    return ", ".join(f"rank {r['rank']} {r['prefill_s_per_token'] or 0:.2e}" for r in ranks)


def pct(xs: list[float], q: float) -> float:
    return float(np.nanpercentile(xs, q)) if xs else float("nan")


def report(title: str, rounds: list[list[RunResult]], bound: float) -> None:
    """Each round's table (the routers in order), the medians over the rounds when there are several, then the
    goals, each paired within a round and the median of the rounds' ratios taken (a slow spell of the machine falls
    on the routers of one round): on a workload that shares, ``kv``'s hit rate against the best peer's and the
    offline bound, and its TTFT p90 against the best peer's; on one that shares nothing (the bound is 0), its p90
    against round robin's."""
    print(f"\n{title}")
    for i, results in enumerate(rounds):
        if len(rounds) > 1:
            print(f"round {i + 1} of {len(rounds)}")
        _table(results, bound)
    if len(rounds) > 1:
        _medians(rounds)
    _goals(rounds, bound)


def _table(results: list[RunResult], bound: float) -> None:
    slow_head = f"engine TTFT > {SLOW_FIRST_TOKEN_S:g} s"
    print(f"{'router':<26} {'hit rate':>8} {'/bound':>7} {'requests per engine':>22} {'TTFT p50':>9} {'p90':>7} "
          f"{'p99':>7} {'req/s':>6} {'failed':>6} {'preempted per engine':>21} {slow_head:>18} {'CPU ms/req':>10}")
    for r in results:
        split = " / ".join(f"{c.requests:.0f}" for c in r.counts)
        preempted = " / ".join(f"{c.preemptions:.0f}" for c in r.counts)
        slow = " / ".join(f"{c.slow_first_tokens:.0f}" for c in r.counts)
        of_bound = f"{r.hit_rate() / bound:>7.2f}" if bound else f"{'-':>7}"
        print(f"{r.router:<26} {r.hit_rate():>8.1%} {of_bound} {split:>22} {pct(r.ttft, 50):>8.3f}s "
              f"{pct(r.ttft, 90):>6.3f}s {pct(r.ttft, 99):>6.3f}s {r.rate():>6.1f} {r.failed:>6} {preempted:>21} "
              f"{slow:>18} {r.router_cpu_s / max(len(r.ttft), 1) * 1e3:>10.2f}")
    ours = results[0]
    print(f"{ours.router} learned seconds per uncached prompt token: {ours.learned or '-'}")


def _medians(rounds: list[list[RunResult]]) -> None:
    """Per router, the median over the rounds, with the lowest and highest, of its hit rate, TTFT p90 and rate."""
    print(f"medians over {len(rounds)} rounds [lowest - highest]")
    print(f"{'router':<26} {'hit rate':>22} {'TTFT p90':>24} {'req/s':>7}")
    for runs in zip(*rounds):
        hits, p90s = [r.hit_rate() for r in runs], [pct(r.ttft, 90) for r in runs]
        print(f"{runs[0].router:<26} {statistics.median(hits):>6.1%} [{min(hits):.1%} - {max(hits):.1%}] "
              f"{statistics.median(p90s):>7.3f}s [{min(p90s):.3f} - {max(p90s):.3f}] "
              f"{statistics.median(r.rate() for r in runs):>7.1f}")


def _goals(rounds: list[list[RunResult]], bound: float) -> None:
    def line(ratios: list[float], goal: str, met: Callable[[float], bool]) -> str:
        k = sum(map(met, ratios))
        within = f", met in {k} of {len(ratios)} rounds" if len(ratios) > 1 else ""
        return f"{statistics.median(ratios):.3f} (goal {goal}{within})"

    ours, peers = [r[0] for r in rounds], [r[1:] for r in rounds]
    if not bound:
        rr = [next((p for p in ps if p.router == "vllm-router round_robin"), None) for ps in peers]
        if all(rr):
            ratios = [pct(o.ttft, 90) / pct(r.ttft, 90) for o, r in zip(ours, rr)]
            print("kv / round robin (nothing shared): TTFT p90 " + line(ratios, "<= 1.1", lambda x: x <= 1.1))
    elif all(peers):
        hit = [o.hit_rate() / max(p.hit_rate() for p in ps) for o, ps in zip(ours, peers)]
        p90 = [pct(o.ttft, 90) / min(pct(p.ttft, 90) for p in ps) for o, ps in zip(ours, peers)]
        of_bound = [o.hit_rate() / bound for o in ours]
        print("kv / best peer: hit rate " + line(hit, ">= 1", lambda x: x >= 1) + ", TTFT p90 "
              + line(p90, "<= 1", lambda x: x <= 1) + "; kv / offline bound "
              + line(of_bound, ">= 0.95", lambda x: x >= 0.95) + f"; offline bound {bound:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=200, help="KV blocks per engine (--num-gpu-blocks-override)")
    ap.add_argument("--workload", default="docs",
                    help=f"one or a comma list of {sorted(WORKLOADS)}, all on the same servers")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rate", type=float, default=None,
                    help="requests per second offered (default: a closed loop, --concurrency always in flight)")
    ap.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated, of: " + ", ".join(ROUTERS))
    ap.add_argument("--slow", action="store_true", help="also run with engine 0 slowed by another tenant")
    ap.add_argument("--slow-streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every router this many times, one after the other in each round (medians printed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm", action="append", metavar="URL", help="servers already running (started as above)")
    ap.add_argument("--serve-router", help=argparse.SUPPRESS)
    policies = add_policy_flags(ap, ["kv"])   # the kvledger router's policy
    args = ap.parse_args()
    if args.serve_router:
        serve_kvledger(json.loads(args.serve_router))
        return
    try:
        options = policies.options(args, ["kv"]).get("kv", {})
    except ValueError as e:
        ap.error(str(e))
    if args.rounds < 1:
        ap.error(f"--rounds: at least 1, got {args.rounds}")
    routers = args.routers.split(",")
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown or routers[0] != ROUTERS[0]:
        ap.error(f"--routers: the first is {ROUTERS[0]!r}, each one of {ROUTERS}; got {unknown or routers}")
    names = args.workload.split(",")
    if any(n not in WORKLOADS for n in names):
        ap.error(f"--workload: each of {sorted(WORKLOADS)}, got {names}")
    traces = [workload(n, WorkloadConfig(block_size=BLOCK, rate_per_s=args.rate or 1.0, seed=args.seed)) for n in names]
    if args.rate is None:
        traces = [Trace(t.name, t.block_size, [dataclasses.replace(r, timestamp_s=0.0) for r in t.requests])
                  for t in traces]
    with tempfile.TemporaryDirectory(prefix="bench-routers-") as tmp:
        servers = [] if args.vllm else start_servers(Path(tmp), args.engines, args.blocks)
        try:
            urls = args.vllm or [s.url for s in servers]
            with httpx.Client(timeout=10.0) as c:
                model = c.get(f"{urls[0]}/v1/models").json()["data"][0]["id"]
            events = event_endpoints(urls)
            modes = [("even", 0)] + ([("engine 0 slowed", args.slow_streams)] if args.slow else [])
            for trace in traces:
                bound = offline_bound(trace, [args.blocks] * len(urls))
                for mode, streams in modes:
                    rounds = [[run(name, urls, events, model, trace, args.concurrency, streams, options)
                               for name in routers] for _ in range(args.rounds)]
                    offered = f"at {args.rate:g}/s" if args.rate else "in a closed loop"
                    report(f"{trace.name}, {len(trace.requests)} requests {offered}, {args.concurrency} in flight; "
                           f"{len(urls)} vLLM servers of {args.blocks} blocks of {BLOCK} tokens; {mode}"
                           + "".join(f"; kv {k} {v}" for k, v in options.items()), rounds, bound)
        finally:
            for s in servers:
                s.stop()


if __name__ == "__main__":
    main()
