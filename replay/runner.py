"""Run the bench: load or generate the trace, compute the bounds, replay every policy (in parallel
processes when asked), and summarise. The CLI (``launch/bench_cli.py``) only parses flags into a
``BenchConfig`` and calls ``run``."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
from collections.abc import Callable

from kvledger.replay.bounds import compute_bounds
from kvledger.replay.config import SYNTHETIC, SYNTHETIC_BLOCK_SIZE, SYNTHETIC_REQUESTS, BenchConfig
from kvledger.replay.report import summarize
from kvledger.replay.result import BenchResult
from kvledger.replay.simulator import PolicyRun, RouteHasher, SimConfig, check_fits, simulate
from kvledger.replay.tiny import run_tiny
from kvledger.replay.trace import (MOONCAKE_BLOCK_SIZE, BlockChains, SyntheticConfig, Trace, generate_synthetic,
                                   load_mooncake)
from kvledger.replay.vllm import run_vllm
from kvledger.replay.workloads import WORKLOADS, WorkloadConfig, workload


def load_trace(config: BenchConfig) -> tuple[Trace, int]:
    """The trace (limited) and the ledgers' tokens per block."""
    if config.trace == SYNTHETIC:
        tpb = config.tokens_per_block or SYNTHETIC_BLOCK_SIZE
        trace = generate_synthetic(SyntheticConfig(requests=config.limit or SYNTHETIC_REQUESTS, block_size=tpb,
                                                   seed=config.seed))
        return trace, tpb
    if config.trace in WORKLOADS:
        tpb = config.tokens_per_block or SYNTHETIC_BLOCK_SIZE
        return workload(config.trace, WorkloadConfig(block_size=tpb, seed=config.seed)).limited(config.limit), tpb
    trace = load_mooncake(config.trace).limited(config.limit)
    return trace, config.tokens_per_block or MOONCAKE_BLOCK_SIZE


# --- parallel replay ------------------------------------------------------------------------------

_WORKER: dict[str, object] = {}


def _worker_init(trace: Trace, sim: SimConfig, chains: list[list[int]], progress_queue: object) -> None:
    _WORKER.update(trace=trace, sim=sim, chains=chains, queue=progress_queue, hasher=RouteHasher(sim.tokens_per_block))


def _worker_run(policy: str) -> PolicyRun:
    q = _WORKER["queue"]
    return simulate(_WORKER["trace"], policy, _WORKER["sim"],  # type: ignore[arg-type]
                    progress=lambda k: q.put((policy, k)), chains=_WORKER["chains"],  # type: ignore[union-attr]
                    hasher=_WORKER["hasher"])  # type: ignore[arg-type]


def replay_all(trace: Trace, sim: SimConfig, policies: list[str], chains: list[list[int]], jobs: int,
               progress: Callable[[str, int], None] | None = None) -> dict[str, PolicyRun]:
    """Every policy on the same trace; ``jobs`` > 1 runs them in spawned processes (results are identical:
    the replay depends only on the trace, the config and the seed)."""
    if jobs <= 1 or len(policies) == 1:
        out = {}
        hasher = RouteHasher(sim.tokens_per_block)
        for p in policies:
            out[p] = simulate(trace, p, sim, progress=(lambda k, p=p: progress(p, k)) if progress else None,
                              chains=chains, hasher=hasher)
        return out
    ctx = mp.get_context("spawn")   # no fork under the progress bar's thread; same on every OS
    q = ctx.Queue()
    with ctx.Pool(jobs, initializer=_worker_init, initargs=(trace, sim, chains, q)) as pool:
        pending = {p: pool.apply_async(_worker_run, (p,)) for p in policies}
        out = {}
        while len(out) < len(policies):
            try:
                name, k = q.get(timeout=0.2)
                if progress:
                    progress(name, k)
                continue
            except queue_mod.Empty:
                pass
            for p, res in pending.items():
                if p not in out and res.ready():
                    out[p] = res.get()
        while True:   # drain what was reported after the last result
            try:
                name, k = q.get_nowait()
            except queue_mod.Empty:
                break
            if progress:
                progress(name, k)
    return {p: out[p] for p in policies}


def run(config: BenchConfig, progress: Callable[[str, int], None] | None = None,
        on_trace: Callable[[Trace, list[str]], None] | None = None) -> BenchResult:
    """Load, bound, replay, summarise. ``on_trace`` is told the trace and policies before replay starts
    (the CLI opens its progress bars there). ``engine="tiny"`` replays over HTTP through a real local cluster
    instead (``kvledger.replay.tiny.run_tiny``), ``engine="vllm"`` through real vLLM servers
    (``kvledger.replay.vllm.run_vllm``)."""
    if config.engine == "tiny":
        return run_tiny(config, progress, on_trace)
    if config.engine == "vllm":
        return run_vllm(config, progress, on_trace)
    wall0 = time.perf_counter()
    trace, tpb = load_trace(config)
    chains_of = BlockChains(trace.block_size, tpb)
    chains = [chains_of.chain(r) for r in trace.requests]
    unique = len(chains_of)
    capacity = config.capacity_blocks
    if capacity is None:
        largest = max((-(-(r.input_length + r.output_length) // tpb) for r in trace.requests), default=1)
        capacity = max(unique // 4, 2 * largest * config.ranks)
    sim = SimConfig(ranks=config.ranks, capacity_blocks=capacity, host_blocks=config.host_blocks,
                    tokens_per_block=tpb, speed=config.speed, partial_reuse=config.partial_reuse,
                    migration=config.migration, seed=config.seed, costs=config.costs, routers=config.routers,
                    event_lag_s=config.event_lag_s, load_report_s=config.load_report_s, slowdown=config.slowdown,
                    policy_options=config.policy_options)
    check_fits(trace, sim)
    # the pooled cache holds everything the cluster can keep: device and host tiers
    bounds = compute_bounds(chains, [r.input_length for r in trace.requests], tpb, capacity + config.host_blocks)
    policies = config.policies
    jobs = config.jobs or min(len(policies), os.cpu_count() or 1)
    if on_trace is not None:
        on_trace(trace, policies)
    runs = replay_all(trace, sim, policies, chains, jobs, progress)
    summaries = {p: summarize(r, bounds, sim.ranks) for p, r in runs.items()}
    return BenchResult(trace, sim, bounds, runs, summaries, time.perf_counter() - wall0, unique)


__all__ = ["BenchConfig", "BenchResult", "load_trace", "replay_all", "run"]
