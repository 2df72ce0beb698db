"""Prefill and decode across two real vLLM servers: kvledger's split beside vllm-router's P/D mode and whole serving.

Issue 29's vLLM P/D bench. Two vLLM 0.32 CPU servers on the tiny checkpoint, a
core each, with the KV connector the CPU build runs (``ExampleConnector``, one
folder both share, ``kv_both``: the example connector writes and reads whatever
its role): server 0 prefills, server 1 decodes. One
workload of ``replay.workloads`` (long unshared prompts, ``unique``, by default)
goes, as text and streamed, through each router in turn, each a process of its
own, the servers' prefix caches and the shared folder emptied before each:

- ``kvledger P/D``: ``--vllm-prefill`` server 0, ``--vllm`` server 1, every prompt split (``--split-mode always``);
- ``kvledger P/D cost``: the same servers, split where the router's estimate says it pays;
- ``vllm-router P/D``: ``--vllm-pd-disaggregation --prefill`` server 0 ``--decode`` server 1 (its default
  ``cache_aware`` policy), the peer from PyPI (``replay.peers``);
- ``kvledger whole``: both servers serve whole requests (``--policy kv``), the same servers unsplit (a prompt one
  of them wrote to the folder is read by the other as well: the example connector shares it).

TTFT is the first streamed chunk, inter-token latency the gaps between a stream's
chunks, throughput the output tokens over the run. From the servers' own
``/metrics``: prompt tokens each computed (its prompt tokens less its prefix-cache
and connector hits) and the tokens the decode server's connector supplied (what
a split handed over). kvledger's figures are printed over vllm-router P/D's and
over whole serving's.

    python benchmarks/bench_vllm_pd.py [--workload unique] [--prefix-tokens 1024] [--output-tokens 32]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
from bench_routers import KvledgerRouter, RunResult, pct, replay
from vllm_engines import start_bench_servers

from kvledger.replay.engine_totals import EngineTotals
from kvledger.replay.peers import RouterProcess, peer_venv
from kvledger.replay.trace import Trace
from kvledger.replay.workloads import WORKLOADS, WorkloadConfig, workload

BLOCK = 32
ROUTERS = ("kvledger P/D", "kvledger P/D cost", "vllm-router P/D", "kvledger whole")
MIN_SPLIT_TOKENS = 64


class VllmRouterPd(RouterProcess):
    """vllm-router in its P/D mode: ``prefill`` computes each prompt, ``decode`` decodes it."""

    def __init__(self, prefill: str, decode: str, model: str) -> None:
        from kvledger.coordinator.router_actor import free_port

        port = free_port("127.0.0.1")
        cmd = [str(peer_venv() / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1"))]
        super().__init__("vllm-router P/D", cmd, model, port)


def start_router(name: str, urls: list[str], model: str) -> RouterProcess:
    prefill, decode = urls
    if name == "vllm-router P/D":
        return VllmRouterPd(prefill, decode, model)
    if name == "kvledger whole":
        return KvledgerRouter("kv", urls, model)
    mode = "cost" if name.endswith("cost") else "always"
    return KvledgerRouter("kv", [decode], model, {"prefill": [prefill], "split_mode": mode,
                                                  "min_split_tokens": MIN_SPLIT_TOKENS})


def run(name: str, urls: list[str], store: Path, model: str, trace: Trace, concurrency: int) -> RunResult:
    """One router over the trace, from empty caches and an empty folder."""
    with httpx.Client(timeout=30.0) as c:
        for url in urls:
            c.post(f"{url}/reset_prefix_cache").raise_for_status()
        for folder in store.iterdir():
            shutil.rmtree(folder)
        router = start_router(name, urls, model)   # its warm-up completion is counted with the run's
        before = [EngineTotals.read(c, u) for u in urls]
        try:
            t0 = time.perf_counter()
            ttft, itl, failed = replay(router, trace, model, concurrency)
            wall = time.perf_counter() - t0
        finally:
            router.close()
        time.sleep(0.5)   # the last counters in
        counts = [EngineTotals.read(c, u).since(b) for u, b in zip(urls, before)]
    return RunResult(name, ttft, itl, failed, counts, wall)


def computed(t: EngineTotals) -> int:
    return round(t.prompt_tokens - t.cached_tokens - t.external_tokens)


def report(title: str, results: list[RunResult], output_tokens: int) -> None:
    print(f"\n{title}")
    print(f"{'router':<18} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'out tok/s':>9} "
          f"{'computed P / D':>15} {'handed over':>11} {'failed':>6}")
    rows = {}
    for r in results:
        ok = len(r.ttft)
        rows[r.router] = {"ttft_p50": pct(r.ttft, 50), "ttft_p99": pct(r.ttft, 99), "itl_p50": pct(r.itl, 50),
                          "itl_p99": pct(r.itl, 99), "tok_s": ok * output_tokens / r.wall_s}
        f = rows[r.router]
        print(f"{r.router:<18} {f['ttft_p50']:>8.3f}s {f['ttft_p99']:>6.3f}s {f['itl_p50'] * 1e3:>6.1f}ms "
              f"{f['itl_p99'] * 1e3:>5.1f}ms {f['tok_s']:>9.1f} "
              f"{computed(r.counts[0]):>7} / {computed(r.counts[1]):<7} {round(r.counts[1].external_tokens):>11} "
              f"{r.failed:>6}")
    for ours in ("kvledger P/D", "kvledger P/D cost"):
        for base in ("vllm-router P/D", "kvledger whole"):
            if ours in rows and base in rows:
                a, b = rows[ours], rows[base]
                print(f"{ours} / {base}: TTFT p50 {a['ttft_p50'] / b['ttft_p50']:.3f}, p99 "
                      f"{a['ttft_p99'] / b['ttft_p99']:.3f}; ITL p50 {a['itl_p50'] / b['itl_p50']:.3f}, p99 "
                      f"{a['itl_p99'] / b['itl_p99']:.3f}; throughput {a['tok_s'] / b['tok_s']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="unique", choices=sorted(WORKLOADS))
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second offered (Poisson)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated, of: " + ", ".join(ROUTERS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    routers = args.routers.split(",")
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        ap.error(f"--routers: each one of {ROUTERS}; got {unknown}")
    config = WorkloadConfig(block_size=BLOCK, prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
                            questions=args.questions, output_tokens=args.output_tokens, rate_per_s=args.rate,
                            seed=args.seed)
    trace = workload(args.workload, config)
    trace = Trace(trace.name, trace.block_size, [dataclasses.replace(r, output_length=args.output_tokens)
                                                 for r in trace.requests])
    with tempfile.TemporaryDirectory(prefix="bench-vllm-pd-") as tmp:
        work = Path(tmp)
        store = work / "store"
        store.mkdir()
        connector = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {"shared_storage_path": str(store)}})
        servers = start_bench_servers(work, ["0", "1"], ("--kv-transfer-config", connector, "--enable-scale-out"),
                                      BLOCK)
        try:
            urls = [s.url for s in servers]
            with httpx.Client(timeout=10.0) as c:
                model = c.get(f"{urls[0]}/v1/models").json()["data"][0]["id"]
            results = [run(name, urls, store, model, trace, args.concurrency) for name in routers]
            report(f"{trace.name}, {len(trace.requests)} requests at {args.rate:g}/s, {args.concurrency} in flight, "
                   f"{args.output_tokens} output tokens each; vLLM server 0 prefills, server 1 decodes "
                   f"(ExampleConnector), a core each", results, args.output_tokens)
        finally:
            for s in servers:
                s.stop()


if __name__ == "__main__":
    main()
