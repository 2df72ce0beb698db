"""``kvledger bench``: the flags, and a call into ``kvledger.replay``; nothing else happens here.

Wiring (``launch/cli.py``)::

    from kvledger.launch.bench_cli import add_bench_parser, run_bench
    add_bench_parser(sub)                       # in _parser(), next to the other sub-commands
    if args.command == "bench": return run_bench(args)   # in main()
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the replay library imports torch; ``kvledger --help`` lists this sub-command without it
    from kvledger.replay.simulator import SimCosts

#: The sub-command's one-line help, for the top-level listing.
HELP = "replay a request trace through the router and ledgers, every policy side by side"


def _number(parse: Callable[[str], float], ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse ``type`` that parses with ``parse`` and accepts what ``ok`` says, naming ``what`` otherwise."""
    def convert(s: str) -> float:
        try:
            v = parse(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return convert


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_nonneg_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number(float, lambda v: 0 < v < float("inf"), "a positive number")
_nonneg_float = _number(float, lambda v: 0 <= v < float("inf"), "a number >= 0")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` to ``subparsers`` (from ``ArgumentParser.add_subparsers``); returns its parser."""
    from kvledger.launch.flags import attribute_docs
    from kvledger.replay.config import (CONCURRENCY, DEFAULT_LIMIT, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS,
                                        REPLICA_EVENT_LAG_S, REPLICA_LOAD_REPORT_S, TINY_BLOCK_SIZE)
    from kvledger.replay.simulator import SimCosts

    p = subparsers.add_parser(
        "bench", help=HELP,
        description="Replay a Mooncake trace (or a synthetic one) through the real router (index, probe, policy) "
                    "and one metadata-only ledger per rank, in simulated time (--engine sim), or over HTTP "
                    "through a real local cluster running the reference engine, times measured (--engine tiny); "
                    "report hit rate against the infinite-cache and pooled-LRU bounds, TTFT, load balance and "
                    "throughput per policy.")
    p.add_argument("--trace", default="synthetic", metavar="FILE|synthetic",
                   help="Mooncake JSONL file, or 'synthetic' (seeded multi-turn, multi-tenant chats; default)")
    p.add_argument("--ranks", type=_positive_int, default=4, help="ranks, one ledger each (default 4)")
    p.add_argument("--policy", default="all", metavar="NAME[,NAME...]|all",
                   help="routing policy, several separated by commas, or 'all' to run every policy on the same "
                        "trace (default all)")
    p.add_argument("--capacity-blocks", type=_positive_int, default=None, metavar="M",
                   help="device blocks per rank (default: the ranks together hold a quarter of the trace's "
                        "unique blocks, at least two of its largest requests each)")
    p.add_argument("--host-blocks", type=_nonneg_int, default=0, metavar="M",
                   help="host-tier blocks per rank, for offload and onboarding (default 0)")
    p.add_argument("--tokens-per-block", type=_positive_int, default=None, metavar="T",
                   help="ledger block size (default: 512 for a Mooncake trace, 64 for synthetic; "
                        f"{TINY_BLOCK_SIZE} with --engine tiny)")
    p.add_argument("--engine", default="sim", metavar="sim|tiny|vllm",
                   help="sim: simulated time, metadata-only ledgers (default); tiny: a real local cluster per "
                        "policy (rank actors, reference engine, router over HTTP on 127.0.0.1), times measured "
                        "(TTFT = completion latency; prompts and outputs capped, see --max-input-tokens); vllm: "
                        "the vLLM servers of --vllm, caches reset before each policy, times measured")
    p.add_argument("--vllm", action="append", default=[], metavar="URL",
                   help="--engine vllm: a vLLM server, http://HOST:PORT (repeat for each; one rank each; started "
                        "with VLLM_SERVER_DEV_MODE=1 so the bench can reset its prefix cache)")
    p.add_argument("--speed", type=_positive_float, default=1.0, metavar="X",
                   help="replay X times faster than the trace's timestamps (default 1)")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="K",
                   help="first K requests only (synthetic: how many to generate, default 1000; "
                        f"--engine tiny: default {DEFAULT_LIMIT})")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace and of the policies' "
                                                       "tie-breaking (default 0)")
    p.add_argument("--json", default=None, metavar="OUT", help="write every figure to this JSON file")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a PNG: hit rate and TTFT per policy, "
                                                                   "per-rank load over time")
    p.add_argument("--jobs", type=_nonneg_int, default=0,
                   help="processes replaying policies in parallel (default: one per CPU core)")
    p.add_argument("--partial-reuse", action="store_true",
                   help="let ledgers reuse partly matching blocks (off: block granularity, like the bounds)")
    p.add_argument("--no-migration", action="store_true", help="never let the kv policy migrate a prefix")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--max-input-tokens", type=_positive_int, default=MAX_INPUT_TOKENS, metavar="N",
                   help=f"--engine tiny: prompts cut to their first N tokens (default {MAX_INPUT_TOKENS})")
    p.add_argument("--max-output-tokens", type=_nonneg_int, default=MAX_OUTPUT_TOKENS, metavar="N",
                   help=f"--engine tiny: outputs capped at N tokens (default {MAX_OUTPUT_TOKENS})")
    p.add_argument("--concurrency", type=_positive_int, default=CONCURRENCY, metavar="N",
                   help=f"--engine tiny: threads sending requests, the most in flight at once (default {CONCURRENCY})")
    p.add_argument("--routers", type=_positive_int, default=1, metavar="N",
                   help="router replicas: replay with 1, 2, 4 ... N replicas, each with its own index fed the same "
                        "events and its own load account, the ranks' load reports their only shared state; print "
                        "hit rate, TTFT and routing precision per count against the 1-router run (--engine sim)")
    p.add_argument("--event-lag-s", type=_nonneg_float, default=REPLICA_EVENT_LAG_S, metavar="S",
                   help="with --routers: simulated seconds an event batch takes to reach the replicas' indexes "
                        f"(default {REPLICA_EVENT_LAG_S:g}, the ranks' push interval)")
    p.add_argument("--load-report-s", type=_nonneg_float, default=REPLICA_LOAD_REPORT_S, metavar="S",
                   help="with --routers: how often the replicas read the ranks' load reports (default "
                        f"{REPLICA_LOAD_REPORT_S:g}, the live router's health round; 0: never)")
    defaults, docs = SimCosts(), attribute_docs(SimCosts)
    for f in fields(SimCosts):
        p.add_argument("--" + f.name.replace("_", "-"), type=float, default=getattr(defaults, f.name),
                       metavar="X", help=f"{docs[f.name]} (default {getattr(defaults, f.name):g})")
    return p


def _costs(args: argparse.Namespace) -> SimCosts:
    from kvledger.replay.simulator import SimCosts

    values = {}
    for f in fields(SimCosts):
        v = getattr(args, f.name)
        values[f.name] = int(v) if f.name == "kv_bytes_per_token" and float(v).is_integer() else v
    return SimCosts(**values)


def _check_outputs(json_path: str | None, plot_path: str | None) -> None:
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None:
            parent = Path(path).resolve().parent
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: directory {str(parent)!r} does not exist")
    if plot_path is not None and not plot_path.lower().endswith(".png"):
        raise ValueError(f"--plot {plot_path}: the plot is a PNG; name it *.png")


def run_bench(args: argparse.Namespace) -> int:
    """Run the bench from parsed flags; prints the table; 0 on success, 2 on bad input (message on stderr)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvledger.replay import report
    from kvledger.replay.config import BenchConfig, TinyOptions
    from kvledger.replay.replicas import render_replicas, replicas_json, sweep
    from kvledger.replay.runner import run

    err = Console(stderr=True)
    try:
        config = BenchConfig(trace=args.trace, ranks=args.ranks, policy=args.policy,
                             capacity_blocks=None if args.capacity_blocks is None
                             else args.capacity_blocks * args.ranks,
                             host_blocks=args.host_blocks * args.ranks,
                             tokens_per_block=args.tokens_per_block, engine=args.engine, speed=args.speed,
                             limit=args.limit, seed=args.seed, partial_reuse=args.partial_reuse,
                             migration=not args.no_migration, jobs=args.jobs, costs=_costs(args),
                             tiny=TinyOptions(max_input_tokens=args.max_input_tokens,
                                              max_output_tokens=args.max_output_tokens,
                                              concurrency=args.concurrency),
                             vllm=tuple(args.vllm), routers=args.routers,
                             **({"event_lag_s": args.event_lag_s, "load_report_s": args.load_report_s}
                                if args.routers > 1 else {}))
        _check_outputs(args.json, args.plot)
    except ValueError as e:
        print(f"kvledger bench: error: {e}", file=sys.stderr)
        return 2
    progress = Progress(TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, disable=args.quiet, transient=False)
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
            if e["failed"] or e["inconsistent"]:
                print(f"{name}: {e['failed']} request(s) failed, {e['inconsistent']} with cached + computed != "
                      f"prompt tokens; first errors: {e['errors']}", file=sys.stderr)
    if args.json:
        doc = report.to_json(result.meta(), result.bounds, result.summaries)
        if replicas is not None:
            doc["replicas"] = replicas_json(replicas)
        report.write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot:
        report.write_plot(args.plot, result.bounds, result.summaries, result.runs, title, measured=measured)
        print(f"wrote {args.plot}")
    return 0
