"""``kvledger bench``: flags built from ``BenchConfig`` (``launch/flags.py``), and a call into ``kvledger.replay``.

Every flag is a field: of ``BenchConfig`` (the trace, ranks, policies, engine),
its ``SimCosts`` and ``TinyOptions``, and of the two small dataclasses below,
``RankBlocks`` (the cache per rank, which ``BenchConfig`` holds for the whole
cluster) and ``Outputs`` (what is written besides the table). A value a
converter refuses ends the parse (exit 2); one a dataclass refuses makes
``run_bench`` return 2, its message naming the flag. ``launch/cli.py`` adds the
parser only when ``bench`` runs: the replay library imports torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvledger.launch.flags import (NONNEG_FLOAT, NONNEG_INT, POSITIVE_FLOAT, POSITIVE_INT, Converter,
                                   DataclassFlags, add_dataclass_flags)
from kvledger.launch.policy_flags import PolicyFlags, add_policy_flags

if TYPE_CHECKING:   # the replay library imports torch; ``kvledger --help`` lists this sub-command without it
    from kvledger.replay.config import BenchConfig, TinyOptions
    from kvledger.replay.simulator import SimCosts

#: The sub-command's one-line help, for the top-level listing.
HELP = "replay a request trace through the router and ledgers, every policy side by side"


@dataclass(frozen=True)
class RankBlocks:
    """The cache of each rank (``BenchConfig`` counts the whole cluster's)."""

    capacity_blocks: int | None = None
    """Device blocks per rank; None = the ranks together hold a quarter of the trace's unique blocks, at least two
    of its largest requests each."""
    host_blocks: int = 0
    """Host-tier blocks per rank, for offload and onboarding."""


@dataclass(frozen=True)
class Outputs:
    """What the bench writes besides the table it prints."""

    json: str | None = None
    """Write every figure to this JSON file."""
    plot: str | None = None
    """Write a PNG here: hit rate and TTFT per policy, per-rank load over time."""
    quiet: bool = False
    """No progress bar."""

    def __post_init__(self) -> None:
        for name, path in (("json", self.json), ("plot", self.plot)):
            if path is not None and not Path(path).resolve().parent.is_dir():
                raise ValueError(f"{name} {path}: directory {str(Path(path).resolve().parent)!r} does not exist")
        if self.plot is not None and not self.plot.lower().endswith(".png"):
            raise ValueError(f"plot {self.plot}: the plot is a PNG; name it *.png")


@dataclass(frozen=True)
class BenchFlags:
    """The flag groups ``add_bench_parser`` added, and the configs built back from the parsed arguments."""

    bench: DataclassFlags[BenchConfig]
    blocks: DataclassFlags[RankBlocks]
    costs: DataclassFlags[SimCosts]
    tiny: DataclassFlags[TinyOptions]
    outputs: DataclassFlags[Outputs]
    policies: PolicyFlags

    def configs(self, args: argparse.Namespace) -> tuple[BenchConfig, Outputs]:
        """The bench's config and its outputs; ``ValueError`` naming the flag for a value a dataclass refuses."""
        blocks = self.blocks.apply(args)
        ranks = self.bench.given(args).get("ranks", self.bench.default.ranks)
        config = self.bench.apply(args, costs=self.costs.apply(args), tiny=self.tiny.apply(args),
                                  capacity_blocks=None if blocks.capacity_blocks is None
                                  else blocks.capacity_blocks * ranks,
                                  host_blocks=blocks.host_blocks * ranks)
        config = dataclasses.replace(config, policy_options=self.policies.options(args, config.policies))
        if config.routers == 1:   # the replicas' delays: one router replays without them
            config = dataclasses.replace(config, event_lag_s=0.0, load_report_s=0.0)
        return config, self.outputs.apply(args)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns its parser.

    The parsed arguments carry the flag groups (``args.bench_flags``), which ``run_bench`` builds the configs
    with.
    """
    from kvledger.replay.config import REPLICA_EVENT_LAG_S, REPLICA_LOAD_REPORT_S, BenchConfig, TinyOptions
    from kvledger.replay.simulator import SimCosts

    p = subparsers.add_parser(
        "bench", help=HELP,
        description="Replay a Mooncake trace (or a synthetic one) through the real router (index, probe, policy) "
                    "and one metadata-only ledger per rank, in simulated time (--engine sim), or over HTTP "
                    "through a real local cluster running the reference engine, times measured (--engine tiny); "
                    "report hit rate against the infinite-cache and pooled-LRU bounds, TTFT, load balance and "
                    "throughput per policy.")
    # Shown as the defaults of --routers N; ``BenchFlags.configs`` clears them for one router.
    replicas = BenchConfig(event_lag_s=REPLICA_EVENT_LAG_S, load_report_s=REPLICA_LOAD_REPORT_S)
    flags = BenchFlags(
        bench=add_dataclass_flags(
            p, replicas, title="replay", exclude=("costs", "tiny", "capacity_blocks", "host_blocks", "policy_options"),
            converters={"trace": Converter(str, metavar="FILE|synthetic|docs|powerlaw|conversation|agents|unique"),
                        "policy": Converter(str, metavar="NAME[,NAME...]|all"),
                        "engine": Converter(str, metavar="sim|tiny|vllm"), "vllm": Converter(str, metavar="URL"),
                        "peer": Converter(str, metavar="NAME[:POLICY]"),
                        "ranks": POSITIVE_INT, "tokens_per_block": POSITIVE_INT, "limit": POSITIVE_INT,
                        "routers": POSITIVE_INT, "jobs": NONNEG_INT, "speed": POSITIVE_FLOAT,
                        "event_lag_s": NONNEG_FLOAT, "load_report_s": NONNEG_FLOAT}),
        blocks=add_dataclass_flags(p, RankBlocks(), title="cache (each rank)",
                                   converters={"capacity_blocks": POSITIVE_INT, "host_blocks": NONNEG_INT}),
        costs=add_dataclass_flags(p, SimCosts(), title="service costs (--engine sim)"),
        tiny=add_dataclass_flags(p, TinyOptions(), title="the tiny and vllm engines",
                                 converters={"max_input_tokens": POSITIVE_INT, "max_output_tokens": NONNEG_INT,
                                             "concurrency": POSITIVE_INT}),
        outputs=add_dataclass_flags(p, Outputs(), title="outputs",
                                    converters={"json": Converter(str, metavar="OUT"),
                                                "plot": Converter(str, metavar="OUT.png")}),
        policies=add_policy_flags(p))
    p.set_defaults(bench_flags=flags)
    return p


def run_bench(args: argparse.Namespace) -> int:
    """Run the bench from parsed flags; prints the table; 0 on success, 2 on bad input (message on stderr)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvledger.replay import report
    from kvledger.replay.replicas import render_replicas, replicas_json, sweep
    from kvledger.replay.runner import run

    err = Console(stderr=True)
    try:
        config, outputs = args.bench_flags.configs(args)
    except ValueError as e:
        print(f"kvledger bench: error: {e}", file=sys.stderr)
        return 2
    progress = Progress(TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, disable=outputs.quiet, transient=False)
    tasks: dict[str, int] = {}

    def on_trace(trace, policies):  # type: ignore[no-untyped-def]
        for p in policies:
            tasks[p] = progress.add_task(p, total=len(trace.requests))

    def advance(policy: str, k: int) -> None:
        progress.advance(tasks[policy], k)

    try:
        with progress:
            replicas = sweep(config, advance, on_trace) if config.routers > 1 else None
            result = run(config, advance, on_trace) if replicas is None else replicas[1]
    except ValueError as e:
        print(f"kvledger bench: error: {e}", file=sys.stderr)
        return 2
    sim = result.sim
    title = (f"{result.trace.name}: {len(result.trace.requests)} requests, {sim.ranks} ranks, "
             f"{sim.capacity_blocks} blocks of {sim.tokens_per_block} tokens, speed {sim.speed:g}")
    measured = result.engine in ("tiny", "vllm")
    if measured:
        caps = result.extra[result.engine]
        title += (f", engine {result.engine} (measured; prompts <= {caps['max_input_tokens']}, "  # type: ignore[index]
                  f"outputs <= {caps['max_output_tokens']} tokens)")  # type: ignore[index]
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)
    if replicas is not None:
        title += " (1 router: the baseline of the replica table below)"
    out.print(report.render_table(result.bounds, result.summaries, title))
    if replicas is not None:
        out.print(render_replicas(replicas))
    print(f"replayed in {sum(r.wall_s for r in replicas.values()) if replicas else result.wall_s:.1f} s wall")
    if measured:
        print(f"engine {result.engine}: TTFT and e2e are the measured completion latency from the scheduled "
              "arrival; load = seconds each rank had a request in flight")
        for name, e in result.extra[result.engine]["policies"].items():  # type: ignore[index, union-attr]
            predicted, delivered = e["predicted_cached_tokens"], e["delivered_cached_tokens"]
            ratio = f"{delivered / predicted:.3f}" if predicted else "-"
            print(f"{name}: cached tokens predicted by the index {predicted}, delivered by the ranks {delivered}, "
                  f"delivered/predicted {ratio}")
            if "engines" in e:
                split = " / ".join(str(x["requests"]) for x in e["engines"])  # type: ignore[union-attr]
                print(f"{name}: the servers' own counters: hit rate {e['engine_hit_rate']:.1%}, requests per "
                      f"server {split}")
            if e["failed"] or e["inconsistent"]:
                print(f"{name}: {e['failed']} request(s) failed, {e['inconsistent']} with cached + computed != "
                      f"prompt tokens; first errors: {e['errors']}", file=sys.stderr)
    if result.engine == "tiny" and config.tiny.prefill_ranks:
        print("\n".join(report.phase_lines(result.extra["tiny"]["policies"])))  # type: ignore[index, arg-type]
    if result.engine == "vllm":
        print(report.peer_goals(result.summaries, result.extra["vllm"]))  # type: ignore[arg-type]
    if outputs.json:
        doc = report.to_json(result.meta(), result.bounds, result.summaries)
        if replicas is not None:
            doc["replicas"] = replicas_json(replicas)
        report.write_json(outputs.json, doc)
        print(f"wrote {outputs.json}")
    if outputs.plot:
        report.write_plot(outputs.plot, result.bounds, result.summaries, result.runs, title, measured=measured)
        print(f"wrote {outputs.plot}")
    return 0
