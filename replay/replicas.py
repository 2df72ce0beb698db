"""``kvledger bench --routers N``: the same trace replayed with 1, 2, 4 ... N router replicas, side by side.

Each replica has an index of its own, fed the same event batches by every rank
(``event_lag_s`` after they were published), and a load account of its own;
the ranks' load reports are the only state they share (``replay.simulator``).
The 1-router run is the baseline: every other count is printed as a ratio
against it, next to the absolute figures. *Routing precision* is the share of
requests, among those some rank held a prefix of, that went to a rank holding
the longest one (SGLang's gateway measured its own falling to 0.12 at 8
gateways that share no index).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvledger.replay.config import BenchConfig
from kvledger.replay.result import BenchResult
from kvledger.replay.trace import Trace

#: What the precision column means, printed under the table.
PRECISION = ("precision: share of the requests some rank held a prefix of (full blocks, per the ranks' ledgers at "
             "the moment of the decision) that went to a rank holding the longest one")


def replica_counts(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself."""
    if type(n) is not int or n < 1:
        raise ValueError(f"--routers must be a positive int, got {n!r}")
    counts = [1]
    while counts[-1] * 2 <= n:
        counts.append(counts[-1] * 2)
    return counts if counts[-1] == n else [*counts, n]


def sweep(config: BenchConfig, progress: Callable[[str, int], None] | None = None,
          on_trace: Callable[[Trace, list[str]], None] | None = None) -> dict[int, BenchResult]:
    """``config`` replayed once per count of ``replica_counts(config.routers)``; the results by count."""
    from kvledger.replay.runner import run

    return {n: run(dataclasses.replace(config, routers=n), progress, on_trace) for n in replica_counts(config.routers)}


def _ratio(value: float, base: float) -> str:
    return f"x{value / base:.2f}" if base else "-"


def render_replicas(results: dict[int, BenchResult]):
    """A ``rich.table.Table``: per policy and replica count, hit rate, TTFT mean and p90 and routing precision,
    each with its ratio against the same policy's 1-router run."""
    from rich.table import Table

    base = results[1]
    sim = base.sim
    t = Table(title=f"router replicas: each its own index (events {sim.event_lag_s * 1e3:g} ms late) and load "
                    f"account, load reports every {sim.load_report_s:g} s; ratios against 1 router",
              caption=PRECISION)
    for col in ("policy", "routers", "hit rate", "vs 1", "TTFT mean", "vs 1", "TTFT p90", "vs 1", "precision",
                "vs 1"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name in base.summaries:
        b, brun = base.summaries[name], base.runs[name]
        for n, res in results.items():
            s, run_ = res.summaries[name], res.runs[name]
            t.add_row(name if n == 1 else "", str(n), f"{s.hit_rate:.1%}", _ratio(s.hit_rate, b.hit_rate),
                      f"{s.ttft_mean_s:.3f}s", _ratio(s.ttft_mean_s, b.ttft_mean_s), f"{s.ttft_p90_s:.3f}s",
                      _ratio(s.ttft_p90_s, b.ttft_p90_s), f"{run_.routing_precision:.3f}",
                      _ratio(run_.routing_precision, brun.routing_precision))
    return t


def replicas_json(results: dict[int, BenchResult]) -> dict[str, object]:
    """The sweep's figures for ``--json``: per replica count, per policy."""
    sim = results[1].sim
    return {"event_lag_s": sim.event_lag_s, "load_report_s": sim.load_report_s, "precision": PRECISION,
            "runs": {str(n): {name: {"hit_rate": s.hit_rate, "ttft_mean_s": s.ttft_mean_s, "ttft_p90_s": s.ttft_p90_s,
                                     "routing_precision": res.runs[name].routing_precision,
                                     "held_prefix": res.runs[name].held_prefix}
                              for name, s in res.summaries.items()}
                     for n, res in results.items()}}
