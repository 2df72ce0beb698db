"""The router's hot path: what each router adds to a short completion, in front of one real vLLM server.

One vLLM 0.32 CPU server on the tiny checkpoint (OpenMP bound to one core, the
router and the client sharing the machine with it), behind each router in
turn, in one run:

- ``direct``: the server itself (the baseline);
- ``kvledger``: kvledger's router in a process of its own, as ``kvledger up --ranks 0 --vllm URL`` fronts the
  server (``bench_routers.py --serve-router``: the ``kv`` policy, subscribed to the server's events);
- ``sglang-router`` (``cache_aware``) and ``vllm-router`` (``kv_aware``, fed the same events), unless
  ``--no-peers``.

For each: the sequential latency p50/p99 of text completions of ``max_tokens`` 1
(each prompt its own), and what it adds over going direct; then requests per
second with ``--concurrency`` in flight, its ratio to direct, and the router's
CPU per request (its processes' user and system time from ``/proc``: what it
takes from the engine on a shared machine, steadier than the rate, which moves
with the machine by 1.5x between rounds); then streamed completions of
``--stream-tokens`` tokens, ``--stream-concurrency`` in flight: streams per
second against direct's, and the router's CPU per stream. Every router
is started first. In each of ``--rounds`` rounds the sequential requests go to
the targets in turn, request by request (the machine is shared, and the
server's own latency drifts by 2x over a run: a slow spell then falls on every
target alike), then each target's burst runs; the medians are reported. The
goals are printed as ratios beside them.

    python benchmarks/bench_http.py [--no-peers] [--vllm URL] [--requests 300] [--burst 1280] [--concurrency 64]
        [--streams 96] [--stream-tokens 64] [--stream-concurrency 8] [--rounds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO / "tests"))   # the real vLLM harness the suite uses
from bench_routers import BLOCK, RouterProcess, start_router
from kvledger.replay.peers import event_endpoints
from vllm_engines import start_bench_servers

#: The routers behind the server, as ``bench_routers.start_router`` names them.
PEERS = ("sglang-router cache_aware", "vllm-router kv_aware")
HTTP_TIMEOUT_S = 60.0
WARMUP = 20
#: The goals (issue #27, item 4): at most this many ms added at p50 over direct, and over the best peer's addition.
ADDED_MS_GOAL = 1.0
#: At least this share of direct throughput with ``--concurrency`` in flight.
THROUGHPUT_GOAL = 0.90


@dataclass(frozen=True)
class Figures:
    name: str
    p50_ms: float
    p99_ms: float
    req_s: float
    streams_s: float
    stream_cpu_ms: float
    """The router's CPU per streamed completion (0 for direct)."""
    req_cpu_ms: float
    """The router's CPU per short completion of the burst (0 for direct)."""


def body(model: str, i: int) -> dict:
    """A short text completion of its own (about 64 tokens: two full blocks and a part)."""
    return {"model": model, "prompt": f"request {i:06d}: the quick brown fox jumps over the lazy dog again",
            "max_tokens": 1}


def sequential(targets: list[tuple[str, str]], model: str, n: int) -> dict[str, list[float]]:
    """``n`` completions one at a time to each target, the targets taking turns request by request (a slow spell
    of the shared machine, or the server's own drift, falls on all of them alike): each one's latencies in ms."""
    out: dict[str, list[float]] = {name: [] for name, _ in targets}
    with ExitStack() as stack:
        clients = [(name, stack.enter_context(httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S)))
                   for name, url in targets]
        for i in range(WARMUP + n):
            for name, c in clients:
                t0 = time.perf_counter()
                r = c.post("/v1/completions", json=body(model, i))
                ms = (time.perf_counter() - t0) * 1e3
                r.raise_for_status()
                if i >= WARMUP:
                    out[name].append(ms)
    return out


async def _burst(url: str, model: str, n: int, concurrency: int) -> float:
    """``n`` completions, ``concurrency`` in flight at all times: requests per second."""
    todo = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S, limits=limits) as c:
        async def worker() -> None:
            for i in todo:
                (await c.post("/v1/completions", json=body(model, 10**6 + i))).raise_for_status()

        await asyncio.gather(*(c.post("/v1/completions", json=body(model, i)) for i in range(concurrency)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0)


def _streams(url: str, model: str, n: int, concurrency: int, tokens: int) -> float:
    """``n`` streamed completions of ``tokens`` tokens, ``concurrency`` in flight: streams per second."""
    body = {"model": model, "max_tokens": tokens, "ignore_eos": True, "stream": True}

    def one(c: httpx.Client, i: int) -> None:
        with c.stream("POST", "/v1/completions", json={**body, "prompt": f"stream {i:06d}: the quick brown fox"}) as r:
            r.raise_for_status()
            for _ in r.iter_raw():
                pass
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S, limits=limits) as c, ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        for f in [pool.submit(one, c, i) for i in range(n)]:
            f.result(timeout=HTTP_TIMEOUT_S * 2)
        return n / (time.perf_counter() - t0)


def measure(targets: list[tuple[str, str, RouterProcess | None]], model: str,
            args: argparse.Namespace) -> list[Figures]:
    """One round: a burst to each target that warms every connection (and the router's threads) up; every
    target's sequential latency, the targets interleaved; then each one's rate at ``--concurrency`` in flight,
    and its streams, in turn. ``targets``: name, URL and the router (``None``: direct)."""
    for _, url, _ in targets:
        asyncio.run(_burst(url, model, WARMUP * args.concurrency // 4, args.concurrency))
    lat = sequential([(name, url) for name, url, _ in targets], model, args.requests)
    round_ = []
    for name, url, router in targets:
        def cpu() -> float:
            return router.cpu_s() if router else 0.0
        cpu0 = cpu()
        rate = asyncio.run(_burst(url, model, args.burst, args.concurrency))
        cpu1 = cpu()
        streams = _streams(url, model, args.streams, args.stream_concurrency, args.stream_tokens)
        req_ms, cpu_ms = (cpu1 - cpu0) / args.burst * 1e3, (cpu() - cpu1) / args.streams * 1e3
        f = Figures(name, statistics.median(lat[name]), float(np.percentile(lat[name], 99)), rate, streams, cpu_ms,
                    req_ms)
        print(f"  {name}: p50 {f.p50_ms:.2f} ms, p99 {f.p99_ms:.2f} ms, {f.req_s:.1f} req/s, router CPU {req_ms:.2f} ms "
              f"per request; {streams:.1f} streams/s, router CPU {cpu_ms:.2f} ms per stream", flush=True)
        round_.append(f)
    return round_


def report(rounds: list[list[Figures]], concurrency: int) -> None:
    """The medians of every target's rounds, then the goals, each figure paired with direct's in its own round
    (a slow spell of the shared machine falls on both sides of a pair) and the median of the pairs taken."""
    keys = ("p50_ms", "p99_ms", "req_s", "streams_s", "stream_cpu_ms", "req_cpu_ms")
    results = [Figures(f[0].name, *(statistics.median(getattr(x, k) for x in f) for k in keys)) for f in zip(*rounds)]
    direct = results[0]
    print(f"\n{'target':<26} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'+p99 ms':>8} "
          f"{f'req/s @{concurrency}':>10} {'/direct':>8} {'CPU ms/req':>11} {'streams/s':>10} {'/direct':>8} "
          f"{'CPU ms/stream':>14}")
    for f in results:
        print(f"{f.name:<26} {f.p50_ms:>7.2f} {f.p99_ms:>7.2f} {f.p50_ms - direct.p50_ms:>8.2f} "
              f"{f.p99_ms - direct.p99_ms:>8.2f} {f.req_s:>10.1f} {f.req_s / direct.req_s:>8.2f} {f.req_cpu_ms:>11.2f} "
              f"{f.streams_s:>10.1f} {f.streams_s / direct.streams_s:>8.2f} {f.stream_cpu_ms:>14.2f}")

    def paired(i: int, what: Callable[[Figures, Figures], float]) -> float:
        return statistics.median(what(r[i], r[0]) for r in rounds)

    added = paired(1, lambda f, d: f.p50_ms - d.p50_ms)
    share = paired(1, lambda f, d: f.req_s / d.req_s)
    verdict = "met" if share >= THROUGHPUT_GOAL else "NOT met"
    print(f"kvledger, paired with direct in each of {len(rounds)} rounds (medians): +{added:.2f} ms at p50, / goal "
          f"{added / ADDED_MS_GOAL:.2f} (goal <= {ADDED_MS_GOAL:g} ms: ratio <= 1); {share:.2f} of direct's req/s at "
          f"{concurrency} in flight (goal >= {THROUGHPUT_GOAL:.2f}: {verdict})")
    if len(results) > 2:
        best = min(range(2, len(results)), key=lambda i: results[i].p50_ms)
        over = statistics.median(r[1].p50_ms - r[best].p50_ms for r in rounds)   # its addition less the peer's
        print(f"kvledger: +{over:.2f} ms at p50 over {results[best].name}'s addition (paired), / goal "
              f"{over / ADDED_MS_GOAL:.2f} (goal <= {ADDED_MS_GOAL:g} ms: ratio <= 1)")
        for what, key in (("short completion", "req_cpu_ms"), ("streamed completion", "stream_cpu_ms")):
            cpu = statistics.median(getattr(r[1], key) / getattr(r[best], key) for r in rounds if getattr(r[best], key))
            print(f"kvledger: {cpu:.2f}x {results[best].name}'s CPU per {what} (paired)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", metavar="URL", help="a server already running (started with --enable-scale-out)")
    ap.add_argument("--no-peers", action="store_true", help="kvledger's router alone against direct")
    ap.add_argument("--requests", type=int, default=300, help="sequential completions per target")
    ap.add_argument("--burst", type=int, default=1280, help="completions per target at --concurrency in flight")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--streams", type=int, default=96, help="streamed completions per target and round")
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens of each streamed completion")
    ap.add_argument("--stream-concurrency", type=int, default=8, help="streams in flight")
    ap.add_argument("--rounds", type=int, default=5,
                    help="every target measured this many times, in turn; the medians are reported")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        core = str(min(os.sched_getaffinity(0)))
        servers = [] if args.vllm else start_bench_servers(Path(tmp), [core], ("--enable-scale-out",), BLOCK)
        try:
            url = args.vllm or servers[0].url
            with httpx.Client(timeout=10.0) as c:
                model = c.get(f"{url}/v1/models").json()["data"][0]["id"]
            event, = event_endpoints([url])
            print(f"one vLLM server at {url}, engine on core {core}; {args.requests} sequential completions "
                  f"(max_tokens 1), {args.burst} at {args.concurrency} in flight, per target", flush=True)
            routers: list[RouterProcess] = []
            try:
                for name in ("kvledger kv", *(() if args.no_peers else PEERS)):
                    routers.append(start_router(name, [url], [event], model))
                targets = [("direct", url, None), *((r.name, r.url, r) for r in routers)]
                rounds = []
                for i in range(args.rounds):
                    print(f"round {i + 1}", flush=True)
                    rounds.append(measure(targets, model, args))
            finally:
                for r in routers:
                    r.close()
            report(rounds, args.concurrency)
        finally:
            for s in servers:
                s.stop()


if __name__ == "__main__":
    main()
