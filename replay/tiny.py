"""``kvledger bench --engine tiny``: the trace replayed over HTTP through a real local cluster, times measured.

For every policy a fresh cluster is started (so every policy starts from empty
caches): ``--ranks`` rank actors, each with a real ledger and the reference
engine (``kvledger.worker.engine.model.TinyDecoder``: real prefill and decode on the CPU), and
the router actor serving the HTTP API on 127.0.0.1 with its policy set to that
policy. The router has no way to switch policy, and its ranks' caches would
carry over anyway, hence one cluster per policy (about 10 s of start-up each).

The workload is the sim engine's, fitted to the reference model:

- token ids are drawn below the reference model's vocabulary (512): each trace
  block id expands to the same deterministic tokens as in the sim
  (``trace.expand_tokens``), reduced modulo 512, so two requests share a prefix
  exactly where the trace says they do;
- prompts are cut to their first ``max_input_tokens`` (default 1024) tokens and
  outputs to ``max_output_tokens`` (default 8) tokens, so a 2-core machine
  keeps up; the bounds are computed on the cut trace, so they stay comparable;
- the block size is ``--tokens-per-block`` (default 16), and a synthetic trace
  uses smaller prompts than the sim's (``TINY_SYNTHETIC``, below), so that the
  cut rarely bites;
- without ``--limit`` the first ``DEFAULT_LIMIT`` (200) requests are replayed.

Requests leave at their arrival times (trace time / ``--speed``) from a thread
pool of ``concurrency`` threads (``POST /v1/completions``, token ids, cache salt
and LoRA id of the trace line). What is measured, per request, in wall-clock
seconds from its scheduled arrival:

- ``ttft_s`` and ``e2e_s`` are both the completion's latency (the API does not
  stream, so the first token is only seen with the whole answer; with at most
  8 output tokens the decode is a small part of it). A request the thread pool
  sent late counts its wait: ``send_lag_max_s`` in the JSON says how late;
- cached tokens come from ``usage.prompt_tokens_details.cached_tokens``,
  computed / onboarded / migrated figures and the rank from ``kvledger``;
- a rank's work is the wall time during which it had at least one request in
  flight (the union of its requests' send-to-answer intervals: its busy time
  plus the HTTP round trips), and the load series plots that per rank over time;
- a request the router refuses with 429 (its queue, or a rank's, was full) is
  shed: counted apart from the failed ones and not sent again; goodput counts
  the answers within the report's TTFT target.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvledger.replay.bounds import compute_bounds
from kvledger.replay.config import (DEFAULT_LIMIT, START_TIMEOUT_S, TINY_BLOCK_SIZE, TINY_SYNTHETIC, BenchConfig,
                                    TinyOptions)
from kvledger.replay.report import summarize
from kvledger.replay.result import BenchResult
from kvledger.replay.simulator import PolicyRun, SimConfig, check_fits, policy_options
from kvledger.replay.trace import (MOONCAKE_BLOCK_SIZE, BlockChains, SyntheticConfig, Trace, TraceRequest,
                                   expand_tokens, generate_synthetic, load_mooncake)
from kvledger.replay.workloads import WORKLOADS, WorkloadConfig, workload
from kvledger.worker.engine.tokenizer import VOCAB_SIZE

# --- the workload -----------------------------------------------------------------------------------

def fit_trace(trace: Trace, max_input_tokens: int, max_output_tokens: int) -> Trace:
    """Every prompt cut to its first ``max_input_tokens`` tokens, every output to ``max_output_tokens``."""
    B = trace.block_size
    out = []
    for r in trace.requests:
        n = min(r.input_length, max_input_tokens)
        out.append(dataclasses.replace(r, input_length=n, output_length=min(r.output_length, max_output_tokens),
                                       hash_ids=r.hash_ids[:-(-n // B)]))
    return Trace(trace.name, B, out)


def tiny_tokens(trace: Trace, req: TraceRequest) -> list[int]:
    """The prompt's token ids, below the reference model's vocabulary (``VOCAB_SIZE`` = 512)."""
    return expand_tokens(req.hash_ids, req.input_length, trace.block_size, vocab_size=VOCAB_SIZE)


def load_tiny_trace(trace: str, limit: int | None, tokens_per_block: int | None, seed: int,
                    options: TinyOptions) -> tuple[Trace, int]:
    """The (limited, fitted) trace and the ledgers' tokens per block."""
    tpb = tokens_per_block or TINY_BLOCK_SIZE
    n = limit or DEFAULT_LIMIT
    if trace == "synthetic":
        t = generate_synthetic(SyntheticConfig(requests=n, block_size=tpb, seed=seed, **TINY_SYNTHETIC))
    elif trace in WORKLOADS:
        t = workload(trace, WorkloadConfig(block_size=tpb, seed=seed)).limited(limit)
    else:
        t = load_mooncake(trace, MOONCAKE_BLOCK_SIZE).limited(n)
    return fit_trace(t, options.max_input_tokens, options.max_output_tokens), tpb


# --- one policy on a fresh cluster ------------------------------------------------------------------

@dataclass(slots=True)
class _Answer:
    ok: bool
    error: str = ""
    rank: int = -1
    prompt: int = 0
    cached: int = 0
    computed: int = 0
    onboarded: int = 0
    migrated: int = 0
    output: int = 0
    sent: float = 0.0
    done: float = 0.0
    predicted: int = 0
    """Cached tokens the router's index predicted on the rank it chose."""
    shed: bool = False
    """The router answered 429: no room for it then (it is not sent again)."""
    first_token_s: float | None = None
    """From the router's dispatch to the first token (``kvledger.phases``: prefill, transfer, the decode rank's
    queue and first step)."""
    inter_token_s: tuple[float, ...] = ()
    transferred: int = 0
    """Blocks moved to the decoding rank before it served the request (a split's, or a migration's)."""
    split: bool = False
    """Prefilled on a prefill rank apart."""


def _union_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _load_series(busy: list[list[tuple[float, float]]], makespan: float,
                 buckets: int) -> tuple[list[list[float]], float]:
    bucket = makespan / buckets if makespan > 0 else 1.0
    series = []
    for intervals in busy:
        s = np.zeros(buckets)
        for a, b in intervals:
            k = min(int(a / bucket), buckets - 1)
            while True:
                edge = (k + 1) * bucket if k < buckets - 1 else math.inf
                s[k] += max(0.0, min(b, edge) - max(a, k * bucket))
                if b <= edge:
                    break
                k += 1
        series.append(np.minimum(s / bucket, 1.0).tolist())
    return series, bucket


class PolicyReplay:
    """Start a cluster and a router with ``policy``, replay the trace over HTTP, tear both down."""

    rank_base = 0
    """The router's number of the first rank (the ranks of a run are ``rank_base`` on, consecutive)."""

    fields: dict[str, object] = {}
    """Fields every request carries besides the trace's (a server's model name)."""

    def __init__(self, trace: Trace, tokens: list[list[int]] | list[str], policy: str, sim: SimConfig,
                 options: TinyOptions, name: str, prefill_ranks: int = 0) -> None:
        self.trace, self.tokens, self.policy, self.sim, self.options, self.name = (trace, tokens, policy, sim,
                                                                                   options, name)
        self.prefill_ranks = prefill_ranks
        """The first this many ranks only prefill (``TinyOptions.prefill_ranks``); 0: every rank serves whole."""

    def router_config(self):  # type: ignore[no-untyped-def]
        """The router actor's settings for this policy: the ledgers' block size, the replay's seed, and
        ``--no-migration`` as the ``kv`` policy's option."""
        from kvledger.coordinator.router_actor import RouterActorConfig
        from kvledger.router.config import RouterConfig

        s, o = self.sim, self.options
        return RouterActorConfig(host="127.0.0.1", port=0, router=RouterConfig(
            tokens_per_block=s.tokens_per_block, policy=self.policy, seed=s.seed,
            policy_options=policy_options(self.policy, s, s.migration),
            prefill_rank_ids=tuple(range(self.prefill_ranks)), split_mode=o.split_mode,
            min_split_tokens=o.min_split_tokens))

    def cache(self):  # type: ignore[no-untyped-def]
        """Each rank's ledger: the reference model's geometry, the replay's share of blocks."""
        import torch

        from kvledger.worker.ledger import CacheConfig

        s = self.sim
        return CacheConfig(tokens_per_block=s.tokens_per_block, num_layers=2, num_kv_heads=2, head_dim=32,
                           dtype=torch.float32, device="cpu", num_primary_blocks=s.capacity_blocks // s.ranks,
                           num_secondary_blocks=s.host_blocks // s.ranks, enable_partial_reuse=s.partial_reuse)

    def _start(self):  # type: ignore[no-untyped-def]
        from kvledger.coordinator.cluster import Cluster
        from kvledger.coordinator.config import ClusterConfig
        from kvledger.coordinator.router_actor import start_router

        s = self.sim
        cache = self.cache()
        cfg = ClusterConfig(num_ranks=s.ranks, device="cpu", cache=cache,
                            num_cpus_per_rank=self.options.num_cpus_per_rank, name_prefix=self.name,
                            group_timeout_s=60, call_timeout_s=START_TIMEOUT_S, seed=s.seed,
                            prefill_ranks=self.prefill_ranks)
        cluster = Cluster.start(cfg)
        try:
            handle, url = start_router(cluster, self.router_config(), name=f"{self.name}-router",
                                       timeout_s=START_TIMEOUT_S)
        except BaseException:
            cluster.shutdown()
            raise
        return cluster, handle, url

    def run(self, progress: Callable[[int], None] | None = None) -> tuple[PolicyRun, dict[str, object]]:
        import httpx
        import ray

        wall0 = time.perf_counter()
        cluster, handle, url = self._start()
        try:
            startup_s = time.perf_counter() - wall0
            return self._replay(url, httpx, progress, startup_s, wall0)
        finally:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass
            cluster.shutdown()

    def _replay(self, url: str, httpx, progress, startup_s: float, wall0: float):  # type: ignore[no-untyped-def]
        reqs = self.trace.requests
        n = len(reqs)
        speed = self.sim.speed
        t_first = reqs[0].timestamp_s if n else 0.0
        arrivals = np.array([(r.timestamp_s - t_first) / speed for r in reqs])
        answers: list[_Answer] = [_Answer(False, "not sent") for _ in range(n)]
        timeout = self.options.request_timeout_s
        c = self.options.concurrency
        limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
        lock = threading.Lock()
        t0 = 0.0

        def send(i: int, client) -> None:  # type: ignore[no-untyped-def]
            r = reqs[i]
            body: dict[str, object] = {"prompt": self.tokens[i], "max_tokens": r.output_length, **self.fields}
            if r.cache_salt is not None:
                body["cache_salt"] = r.cache_salt
            if r.lora_id is not None:
                body["lora_id"] = r.lora_id
            sent = time.perf_counter() - t0
            try:
                resp = client.post("/v1/completions", json=body, timeout=timeout)
                done = time.perf_counter() - t0
                if resp.status_code != 200:
                    a = _Answer(False, f"HTTP {resp.status_code}: {resp.text[:300]}", sent=sent, done=done,
                                shed=resp.status_code == 429)
                else:
                    a = self._answer(resp.json(), sent, done)
            except Exception as e:  # a failed request is reported, never fatal to the replay
                a = _Answer(False, f"{type(e).__name__}: {e}", sent=sent, done=time.perf_counter() - t0)
            answers[i] = a
            if progress is not None:
                with lock:
                    progress(1)

        with httpx.Client(base_url=url, timeout=timeout, limits=limits) as client, \
                cf.ThreadPoolExecutor(max_workers=self.options.concurrency, thread_name_prefix="bench-tiny") as pool:
            t0 = time.perf_counter()
            futures = []
            for i in range(n):   # bounded: one pass over the trace
                wait = arrivals[i] - (time.perf_counter() - t0)
                if wait > 0:
                    time.sleep(wait)   # the next arrival time: nothing else to wait on
                futures.append(pool.submit(send, i, client))
            deadline = timeout * (1 + n / self.options.concurrency) + 60
            _, not_done = cf.wait(futures, timeout=deadline)
            for f in not_done:
                f.cancel()
        replay_s = time.perf_counter() - t0
        return self._result(answers, arrivals, startup_s, replay_s, time.perf_counter() - wall0)

    def _answer(self, d: dict, sent: float, done: float) -> _Answer:
        """One answer's figures: the usage, and what kvledger's router adds (the rank, its computed, onboarded and
        migrated figures, the cached tokens its index predicted)."""
        u, k = d["usage"], d["kvledger"]
        ph = k.get("phases") or {}
        return _Answer(True, "", int(k["rank"]) - self.rank_base, int(u["prompt_tokens"]),
                       int(u["prompt_tokens_details"]["cached_tokens"]), int(k["computed_tokens"]),
                       int(k["onboarded_blocks"]), int(k["migrated_blocks"]), int(u["completion_tokens"]),
                       sent, done, int(k["predicted_cached_tokens"]), first_token_s=ph.get("first_token_s"),
                       inter_token_s=tuple(ph.get("inter_token_s") or ()),
                       transferred=int(ph.get("transferred_blocks") or 0), split=ph.get("prefill_rank") is not None)

    def _result(self, answers: list[_Answer], arrivals: np.ndarray, startup_s: float, replay_s: float,
                wall_s: float) -> tuple[PolicyRun, dict[str, object]]:
        ok = [i for i, a in enumerate(answers) if a.ok]
        failed = [(i, a.error) for i, a in enumerate(answers) if not a.ok]
        A = [answers[i] for i in ok]
        prompt = np.array([a.prompt for a in A], dtype=np.int64)
        cached = np.array([a.cached for a in A], dtype=np.int64)
        computed = np.array([a.computed for a in A], dtype=np.int64)
        latency = np.array([a.done - arrivals[i] for i, a in zip(ok, A)])
        rank = np.array([a.rank for a in A], dtype=np.int64)
        ranks = self.sim.ranks
        busy = [_union_intervals([(a.sent, a.done) for a in A if a.rank == r]) for r in range(ranks)]
        work = [sum(b - a for a, b in iv) for iv in busy]
        makespan = max((a.done for a in A), default=0.0)
        series, bucket = _load_series(busy, makespan, self.sim.load_buckets)
        migrated = [a.migrated for a in A]
        run = PolicyRun(self.policy, prompt, cached, computed, latency, latency.copy(), rank,
                        sum(a.onboarded for a in A), sum(migrated), sum(1 for m in migrated if m), work, series,
                        bucket, makespan, wall_s, sum(a.output for a in A))
        lags = [a.sent - arrivals[i] for i, a in enumerate(answers) if a.sent > 0]
        shed = sum(1 for a in answers if a.shed)
        extra: dict[str, object] = {
            "failed": len(failed) - shed, "shed": shed,
            "errors": [f"request {i}: {e}" for i, e in failed if not answers[i].shed][:5],
            "inconsistent": int(((cached + computed) != prompt).sum()) if len(A) else 0,
            "computed_tokens_per_rank": [int(computed[rank == r].sum()) for r in range(ranks)],
            "send_lag_max_s": round(max(lags, default=0.0), 4), "startup_s": round(startup_s, 2),
            "replay_s": round(replay_s, 2), "predicted_cached_tokens": sum(a.predicted for a in A),
            "delivered_cached_tokens": int(cached.sum()), "phases": self._phases(A, makespan)}
        return run, extra

    def _phases(self, A: list[_Answer], makespan: float) -> dict[str, object]:
        """The answers' phases (own ranks time their tokens): first token and inter-token latency p50/p99, output
        tokens per second over the replay, requests split, bytes moved to decoding ranks."""
        ttft = [a.first_token_s for a in A if a.first_token_s is not None]
        itl = [g for a in A for g in a.inter_token_s]

        def pct(xs: list[float], q: float) -> float | None:
            return round(float(np.percentile(xs, q)), 5) if xs else None

        return {"prefill_ranks": self.prefill_ranks, "split_requests": sum(a.split for a in A),
                "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50),
                "itl_p99_s": pct(itl, 99), "output_tokens_per_s": round(sum(a.output for a in A) / makespan, 2)
                if makespan > 0 else None, "bytes_moved": sum(a.transferred for a in A) * self.block_bytes()}

    def block_bytes(self) -> int:
        """Bytes of one block's KV on these ranks."""
        return self.cache().bytes_per_block


# --- all policies -----------------------------------------------------------------------------------

def run_tiny(config: BenchConfig, progress: Callable[[str, int], None] | None = None,
             on_trace: Callable[[Trace, list[str]], None] | None = None) -> BenchResult:
    """``runner.run`` for ``engine == "tiny"``: a ``BenchResult`` with measured figures (see the module docstring).

    Starts a local Ray on 127.0.0.1 when none is initialised (and shuts it down at the end); in a
    running Ray (the tests' session fixture) it uses that one.
    """
    wall0 = time.perf_counter()
    options = config.tiny
    trace, tpb = load_tiny_trace(config.trace, config.limit, config.tokens_per_block, config.seed, options)
    chains_of = BlockChains(trace.block_size, tpb)
    chains = [chains_of.chain(r) for r in trace.requests]
    unique = len(chains_of)
    ranks = config.ranks
    capacity = config.capacity_blocks
    if capacity is None:
        largest = max((-(-(r.input_length + r.output_length) // tpb) for r in trace.requests), default=1)
        capacity = max(unique // 4, 2 * largest * ranks)
    per_rank = capacity // ranks
    sim = SimConfig(ranks=ranks, capacity_blocks=max(per_rank, 1) * ranks,
                    host_blocks=(config.host_blocks // ranks) * ranks, tokens_per_block=tpb, speed=config.speed,
                    partial_reuse=config.partial_reuse, migration=config.migration, seed=config.seed,
                    policy_options=config.policy_options)
    check_fits(trace, sim)
    bounds = compute_bounds(chains, [r.input_length for r in trace.requests], tpb,
                            sim.capacity_blocks + sim.host_blocks)
    tokens = [tiny_tokens(trace, r) for r in trace.requests]
    split = options.prefill_ranks
    runs_of = [(p, p, 0) for p in config.policies]
    if split:   # each policy again, its first ranks only prefilling
        runs_of += [(f"{p} P/D {split}:{ranks - split}", p, split) for p in config.policies]
    if on_trace is not None:
        on_trace(trace, [name for name, _, _ in runs_of])

    import ray
    started_ray = False
    if not ray.is_initialized():
        from kvledger.coordinator.ray_env import init_ray
        init_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(ranks * options.num_cpus_per_rank)), log_to_driver=False)
        started_ray = True
    runs: dict[str, PolicyRun] = {}
    extras: dict[str, dict[str, object]] = {}
    try:
        for i, (label, p, prefill) in enumerate(runs_of):
            name = f"kvledger-bench-{os.getpid()}-{i}-{p.replace('_', '-')}"
            replay = PolicyReplay(trace, tokens, p, sim, options, name, prefill)
            run, extras[label] = replay.run((lambda k, label=label: progress(label, k)) if progress else None)
            runs[label] = dataclasses.replace(run, policy=label)
    finally:
        if started_ray:
            ray.shutdown()
    summaries = {p: summarize(r, bounds, ranks, shed=int(extras[p]["shed"])) for p, r in runs.items()}
    extra = {"tiny": {"max_input_tokens": options.max_input_tokens, "max_output_tokens": options.max_output_tokens,
                      "concurrency": options.concurrency, "vocab_size": VOCAB_SIZE,
                      "ttft": "measured completion latency from the scheduled arrival (the API does not stream)",
                      "work": "seconds each rank had a request in flight",
                      "policies": extras}}
    return BenchResult(trace, sim, bounds, runs, summaries, time.perf_counter() - wall0, unique, engine="tiny",
                       extra=extra)


__all__ = ["fit_trace", "load_tiny_trace", "run_tiny", "tiny_tokens"]
