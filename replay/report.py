"""Figures of a bench run: per-policy summaries, the rich table, the JSON file and the PNG."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvledger.replay.bounds import Bounds
from kvledger.replay.simulator import PolicyRun

#: Time to first token within which an answer counts as goodput (DistServe's "requests that meet their SLO").
GOODPUT_TTFT_S = 2.0


@dataclass(frozen=True, slots=True)
class PolicySummary:
    hit_rate: float
    """Prompt tokens served from cache (own, onboarded or migrated) / prompt tokens."""
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_mean_s: float
    load_imbalance: float
    """max / mean of the prefill work (busy seconds) per rank; 1.0 = perfectly even."""
    throughput_rps: float
    """Requests / (last completion - first arrival), simulated seconds."""
    onboarded_blocks: int
    migrated_blocks: int
    requests: int
    migrations: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    output_tokens_per_s: float
    hit_rate_vs_pooled_lru: float
    """hit_rate / the pooled-LRU bound (1.0 = as good as one shared LRU cache)."""
    work_per_rank_s: list[float] = field(default_factory=list)
    requests_per_rank: list[int] = field(default_factory=list)
    makespan_s: float = 0.0
    wall_s: float = 0.0
    """Wall-clock seconds this policy's replay took."""
    shed: int = 0
    """Requests the router refused with 429 (no room then): never answered, so not in the TTFT figures."""
    goodput_rps: float = 0.0
    """Requests answered within ``GOODPUT_TTFT_S`` of their arrival, per second of the makespan."""


def summarize(run: PolicyRun, bounds: Bounds, ranks: int, shed: int = 0) -> PolicySummary:
    """The figures of one policy's run; ``shed``: its requests refused with 429 (a replay over HTTP counts them,
    the simulator's ranks queue everything)."""
    prompt = int(run.prompt_tokens.sum())
    cached = int(run.cached_tokens.sum())
    hit = cached / prompt if prompt else 0.0
    n = len(run.ttft_s)
    p50, p90, p99 = (float(x) for x in np.percentile(run.ttft_s, [50, 90, 99])) if n else (0.0, 0.0, 0.0)
    mean_work = sum(run.work_s) / len(run.work_s) if run.work_s else 0.0
    imbalance = max(run.work_s) / mean_work if mean_work > 0 else 1.0
    span = run.makespan_s
    lru = bounds.pooled_lru_hit_rate
    return PolicySummary(
        hit_rate=hit, ttft_mean_s=float(run.ttft_s.mean()) if n else 0.0, ttft_p50_s=p50, ttft_p90_s=p90,
        ttft_p99_s=p99, e2e_mean_s=float(run.e2e_s.mean()) if n else 0.0, load_imbalance=imbalance,
        throughput_rps=n / span if span > 0 else 0.0, onboarded_blocks=run.onboarded_blocks,
        migrated_blocks=run.migrated_blocks, requests=n, migrations=run.migrations, prompt_tokens=prompt,
        cached_tokens=cached, computed_tokens=int(run.computed_tokens.sum()),
        output_tokens_per_s=run.output_tokens / span if span > 0 else 0.0,
        hit_rate_vs_pooled_lru=hit / lru if lru > 0 else math.nan,
        work_per_rank_s=[round(w, 3) for w in run.work_s],
        requests_per_rank=(np.bincount(run.rank, minlength=ranks).tolist() if run.requests_per_rank is None
                           else run.requests_per_rank), makespan_s=span, wall_s=run.wall_s,
        shed=shed, goodput_rps=int((run.ttft_s <= GOODPUT_TTFT_S).sum()) / span if span > 0 else 0.0)


def to_json(meta: dict[str, object], bounds: Bounds, summaries: dict[str, PolicySummary]) -> dict[str, object]:
    """The issue's shape: ``trace``, ``ranks``, ``bounds``, ``policies``; then more fields."""
    out: dict[str, object] = {"trace": meta["trace"], "ranks": meta["ranks"],
                              "bounds": {"infinite_hit_rate": bounds.infinite_hit_rate,
                                         "pooled_lru_hit_rate": bounds.pooled_lru_hit_rate,
                                         "pooled_lru_capacity_blocks": bounds.pooled_lru_capacity_blocks,
                                         "prompt_tokens": bounds.prompt_tokens},
                              "policies": {name: asdict(s) for name, s in summaries.items()}}
    out.update({k: v for k, v in meta.items() if k not in out})
    return out


def peer_goals(summaries: dict[str, PolicySummary], vllm: dict[str, object]) -> str:
    """The lines that put ``kv`` beside the peer routers and the offline bound (a replay through vLLM servers)."""
    split, blocks = vllm["static_split_hit_rate"], vllm["server_blocks"]
    lines = [f"offline bound, the best static split of the workload over the servers' {blocks} blocks: {split:.1%}"
             if blocks else "offline bound: the servers report no block counts"]
    ours, peers = summaries.get("kv"), [summaries[n] for n in vllm["peers"]]  # type: ignore[attr-defined]
    if ours is not None and peers:
        best_hit = max(p.hit_rate for p in peers)
        best_p90 = min(p.ttft_p90_s for p in peers)
        hit = f"{ours.hit_rate / best_hit:.3f}" if best_hit else "-"
        p90 = f"{ours.ttft_p90_s / best_p90:.3f}" if best_p90 else "-"
        lines.append(f"kv / best peer: hit rate {hit} (goal >= 1), TTFT p90 {p90} (goal <= 1)")
    if ours is not None and blocks and split:
        lines.append(f"kv / offline bound: {ours.hit_rate / split:.3f} (goal >= 0.95)")  # type: ignore[operator]
    return "\n".join(lines)


def phase_lines(policies: dict[str, dict]) -> list[str]:
    """``kvledger bench --engine tiny --prefill-ranks N``: each run's phases (``tiny.PolicyReplay._phases``), then
    each split run against the same policy served whole on the same ranks, as ratios."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:.1f} ms"

    phases = {name: e["phases"] for name, e in policies.items()}
    lines = [f"{name}: split {ph['split_requests']} requests, TTFT p50 {ms(ph['ttft_p50_s'])} p99 "
             f"{ms(ph['ttft_p99_s'])}, inter-token p50 {ms(ph['itl_p50_s'])} p99 {ms(ph['itl_p99_s'])}, "
             f"{ph['output_tokens_per_s']} output tokens/s, {ph['bytes_moved'] / 2**20:.1f} MiB moved"
             for name, ph in phases.items()]
    for name, ph in phases.items():
        base = phases.get(name.split(" P/D ")[0])
        if " P/D " not in name or base is None:
            continue

        def ratio(key: str) -> str:
            a, b = ph[key], base[key]
            return f"{a / b:.3f}" if a is not None and b else "-"

        lines.append(f"{name} / whole: inter-token p99 {ratio('itl_p99_s')} (goal < 1), p50 {ratio('itl_p50_s')}, "
                     f"TTFT p99 {ratio('ttft_p99_s')}, throughput {ratio('output_tokens_per_s')} (goal >= 1)")
    return lines


def write_json(path: str | Path, doc: dict[str, object]) -> None:
    Path(path).write_text(json.dumps(doc, indent=2, allow_nan=False, default=_nan_free) + "\n")


def _nan_free(o: object) -> object:
    raise TypeError(f"not JSON: {type(o).__name__}")


def render_table(bounds: Bounds, summaries: dict[str, PolicySummary], title: str):
    """A ``rich.table.Table`` of the figures (best TTFT in bold)."""
    from rich.table import Table

    t = Table(title=title, caption=f"bounds on this trace: infinite cache {bounds.infinite_hit_rate:.1%}, "
                                  f"pooled LRU ({bounds.pooled_lru_capacity_blocks} blocks) "
                                  f"{bounds.pooled_lru_hit_rate:.1%}")
    for col in ("policy", "hit rate", "/LRU", "TTFT mean", "p50", "p90", "p99", "e2e mean", "max/mean load",
                "req/s", f"goodput (TTFT<={GOODPUT_TTFT_S:g}s)/s", "shed", "onboarded", "migrated", "requests"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    best_mean = min((s.ttft_mean_s for s in summaries.values()), default=0.0)
    best_p99 = min((s.ttft_p99_s for s in summaries.values()), default=0.0)
    for name, s in summaries.items():
        mean = f"{s.ttft_mean_s:.3f}s"
        p99 = f"{s.ttft_p99_s:.3f}s"
        t.add_row(name, f"{s.hit_rate:.1%}", "-" if math.isnan(s.hit_rate_vs_pooled_lru)
                  else f"{s.hit_rate_vs_pooled_lru:.0%}",
                  f"[bold]{mean}[/]" if s.ttft_mean_s == best_mean else mean,
                  f"{s.ttft_p50_s:.3f}s", f"{s.ttft_p90_s:.3f}s",
                  f"[bold]{p99}[/]" if s.ttft_p99_s == best_p99 else p99,
                  f"{s.e2e_mean_s:.2f}s", f"{s.load_imbalance:.2f}", f"{s.throughput_rps:.2f}",
                  f"{s.goodput_rps:.2f}", str(s.shed), str(s.onboarded_blocks), str(s.migrated_blocks),
                  str(s.requests))
    return t


def write_plot(path: str | Path, bounds: Bounds, summaries: dict[str, PolicySummary],
               runs: dict[str, PolicyRun], title: str, measured: bool = False) -> None:
    """Hit rate (with both bounds) and TTFT percentiles per policy on top; per-rank load over time below, for the
    runs that know it (``measured``: wall-clock time of a real replay, ``--engine tiny``, rather than simulated
    time)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summaries)
    loaded = [n for n in names if runs[n].load_series]   # a peer router does not say which rank served a request
    cols = 4
    rows = 1 + -(-len(loaded) // cols)
    fig = plt.figure(figsize=(16, 4.2 * rows), constrained_layout=True)
    grid = fig.add_gridspec(rows, cols)
    fig.suptitle(title, fontsize=13)

    ax = fig.add_subplot(grid[0, :2])
    x = np.arange(len(names))
    ax.bar(x, [summaries[n].hit_rate * 100 for n in names], color="tab:blue")
    ax.axhline(bounds.infinite_hit_rate * 100, color="black", ls="--", label="infinite cache")
    ax.axhline(bounds.pooled_lru_hit_rate * 100, color="tab:red", ls=":", label="pooled LRU (same capacity)")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("prompt tokens from cache (%)")
    ax.set_title("hit rate (higher is better)")
    ax.legend(loc="upper right", fontsize=8)

    ax = fig.add_subplot(grid[0, 2:])
    width = 0.2
    for k, (label, attr) in enumerate((("mean", "ttft_mean_s"), ("p50", "ttft_p50_s"), ("p90", "ttft_p90_s"),
                                       ("p99", "ttft_p99_s"))):
        vals = [max(getattr(summaries[n], attr), 1e-4) for n in names]
        ax.bar(x + (k - 1.5) * width, vals, width, label=label)
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title("TTFT (lower is better)")
    ax.legend(fontsize=8, ncol=4)

    for k, name in enumerate(loaded):
        run = runs[name]
        ax = fig.add_subplot(grid[1 + k // cols, k % cols])
        t = (np.arange(len(run.load_series[0])) + 0.5) * run.bucket_s if run.load_series else np.array([])
        for r, series in enumerate(run.load_series):
            ax.plot(t, np.asarray(series) * 100, lw=1, label=f"rank {r}")
        s = summaries[name]
        what = "request in flight" if measured else "prefill busy"
        ax.set_title(f"{name}: {what} per rank (max/mean {s.load_imbalance:.2f})", fontsize=9)
        ax.set_ylim(0, 105)
        ax.set_xlabel("wall-clock time (s)" if measured else "simulated time (s)")
        if k % cols == 0:
            ax.set_ylabel("busy (%)")
        if k == 0:
            ax.legend(fontsize=7, loc="upper right")
    fig.savefig(path, dpi=100)
    plt.close(fig)
