"""``kvledger``: parses arguments and calls the library, nothing more.

Only the sub-command being run gets its flags built (``kvledger --help`` still
lists every sub-command with its one-line help): ``up``'s flags come from the
config dataclasses, which import torch and Ray, and ``route``, ``monitor``,
``status`` and ``down`` start without either.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvledger.launch.up import UpOptions

Run = Callable[[argparse.Namespace], int]
"""A sub-command's action on the parsed arguments; returns the exit status."""
AddFlags = Callable[[argparse.ArgumentParser], Run]
"""Adds a sub-command's flags to its parser; returns its action."""


def _demo(p: argparse.ArgumentParser) -> Run:
    def run(args: argparse.Namespace) -> int:
        from kvledger.launch.demo import run_demo
        run_demo()
        return 0
    return run


def _vllm_endpoint(spec: str) -> str:
    """``--vllm-events``' value, checked when parsed so a bad one names the flag."""
    from kvledger.router.feed import parse_vllm_endpoint
    parse_vllm_endpoint(spec)
    return spec


def _given_budgets_win(cache_given: dict[str, object], cluster_given: dict[str, object],
                       ) -> tuple[dict[str, None], dict[str, None]]:
    """The budgets to clear (cache's, cluster's) so that the ones the user gave take effect.

    The default cache sets its budgets in bytes, which win over block counts, so a tier's block count given
    without its byte budget clears that budget; on CUDA the device tier takes ``gpu_memory_fraction`` over any budget,
    so a device-tier budget given without ``--gpu-memory-fraction`` clears the fraction.
    """
    cache_budgets = {budget: None for blocks, budget in (("num_primary_blocks", "primary_bytes"),
                                                         ("num_secondary_blocks", "secondary_bytes"))
                     if blocks in cache_given and budget not in cache_given}
    device_budget = cache_given.keys() & {"primary_bytes", "num_primary_blocks"}
    cluster_budgets = ({"gpu_memory_fraction": None}
                       if device_budget and "gpu_memory_fraction" not in cluster_given else {})
    return cache_budgets, cluster_budgets


def _up_flags(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], UpOptions]:
    """Add ``up``'s flags, built from the config dataclasses; returns what assembles the validated options.

    Groups: the cluster (``ClusterConfig``), each rank's cache (``CacheConfig``), the router
    (``RouterConfig``), each routing policy's options (``--<policy>-<field>``) and the router's HTTP API
    (``RouterActorConfig``). A bad value ends the program with exit 2 and a message naming its flag.
    """
    import torch

    from kvledger.coordinator.config import ClusterConfig, default_cache
    from kvledger.coordinator.router_actor import RouterActorConfig
    from kvledger.launch.flags import SIZE, SIZES, Converter, add_dataclass_flags
    from kvledger.launch.policy_flags import add_policy_flags
    from kvledger.launch.up import UpOptions
    from kvledger.router.config import RouterConfig
    from kvledger.router.policies import policy_names
    from kvledger.worker.ledger.config import parse_window

    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="join this Ray cluster (e.g. one made with `ray start --head`) instead of starting one")
    p.add_argument("--workload", choices=["bundled"], default=None,
                   help="route the bundled workload through the cluster, print each request, then stop")
    p.add_argument("--no-router", action="store_true", help="start the ranks only (Python API)")
    p.add_argument("--detach", action="store_true",
                   help="return once the cluster is healthy; stop it later with `kvledger down`")
    cluster = add_dataclass_flags(
        p, ClusterConfig(), title="cluster", exclude=("cache", "detached"),
        rename={"num_ranks": "ranks", "num_cpus_per_rank": "cpus-per-rank"},
        converters={"primary_bytes_per_rank": SIZES})
    cache = add_dataclass_flags(
        p, default_cache(), title="cache (each rank)", exclude=("device", "materialize", "window_blocks"),
        description="A tier's block count given without its byte budget replaces that budget; on CUDA a "
                    "device-tier budget given without --gpu-memory-fraction replaces the GPU memory share.",
        converters={"dtype": Converter.choice({"float16": torch.float16, "bfloat16": torch.bfloat16,
                                               "float32": torch.float32}),
                    "primary_bytes": SIZE, "secondary_bytes": SIZE,
                    "attention_windows": Converter(parse_window, lambda w: "full" if w is None else str(w),
                                                   "TOKENS|full")})
    router = add_dataclass_flags(
        p, RouterConfig(), title="router", exclude=("tokens_per_block", "policy_options", "prefill_rank_ids"),
        rename={"seed": "router-seed"}, converters={"policy": Converter.choice({n: n for n in policy_names()})})
    policies = add_policy_flags(p)
    http = add_dataclass_flags(p, RouterActorConfig(), title="router HTTP API",
                               exclude=("router", "transport_faults"),   # faults: set from the config, for tests
                               rename={"max_restarts": "router-max-restarts"},
                               converters={"vllm_events": Converter(_vllm_endpoint, metavar="TCP[,REPLAY]")})

    def policy_options(args: argparse.Namespace, chosen: str) -> dict[str, object]:
        """The options given for policy ``chosen`` (checked by its config); another policy's option is an error."""
        try:
            return policies.options(args, [chosen]).get(chosen, {})
        except ValueError as e:
            p.error(str(e))

    def options(args: argparse.Namespace) -> UpOptions:
        cache_budgets, cluster_budgets = _given_budgets_win(cache.given(args), cluster.given(args))
        roles = cluster.given(args)
        ranks = ({"num_ranks": roles.get("prefill_ranks", 0) + roles["decode_ranks"]}   # --prefill-ranks N
                 if "decode_ranks" in roles and "num_ranks" not in roles else {})         # --decode-ranks M: N + M
        cluster_config = cluster.build(args, p, cache=cache.build(args, p, **cache_budgets), **cluster_budgets,
                                       **ranks, detached=args.address is not None or args.workload is None)
        chosen = router.given(args).get("policy", router.default.policy)
        router_config = router.build(args, p, policy_options=policy_options(args, chosen))
        http_config = http.build(args, p, router=router_config)
        if args.no_router:
            ignored = [g.flags[f] for g in (router, *policies.groups.values(), http) for f in g.given(args)]
            if ignored:
                p.error(f"--no-router starts no router; drop {', '.join(ignored)}")
        if args.detach and args.workload is not None:
            p.error("--workload runs and stops; it cannot be combined with --detach")
        try:
            return UpOptions(cluster_config, None if args.no_router else http_config, args.address, args.workload)
        except ValueError as e:
            p.error(str(e))

    return options


def _up(p: argparse.ArgumentParser) -> Run:
    options = _up_flags(p)

    def run(args: argparse.Namespace) -> int:
        from kvledger.launch import up
        opts = options(args)
        return up.up_detached(opts) if args.detach else up.up(opts)
    return run


def _route(p: argparse.ArgumentParser) -> Run:
    p.add_argument("prompt")
    p.add_argument("--url", default=None,
                   help="router URL (default: the running cluster's first replica that is ready, else :8000)")
    p.add_argument("--router-index", type=int, default=None, metavar="I",
                   help="the running cluster's router replica I (0-based; `kvledger status` lists them)")
    p.add_argument("--salt", default=None, help="cache salt: only prompts with the same salt share KV")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default=None, help="a model of the router's /v1/models (default: the first)")
    p.add_argument("--chat", action="store_true", help="send it as a user message to /v1/chat/completions")
    p.add_argument("--stream", action="store_true", help="print the answer as it streams in")
    p.add_argument("--api-key", default=None, help="the router's API key (default: $KVLEDGER_API_KEY)")

    def run(args: argparse.Namespace) -> int:
        from kvledger.launch.router_client import route
        return route(args.prompt, url=args.url, salt=args.salt, max_tokens=args.max_tokens, model=args.model,
                     chat=args.chat, stream=args.stream, api_key=args.api_key, router_index=args.router_index)
    return run


def _monitor(p: argparse.ArgumentParser) -> Run:
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--json", action="store_true", help="newline-delimited JSON events")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (default: Ctrl-C)")
    p.add_argument("--url", default=None,
                   help="router URL (default: the running cluster's first replica that is ready, else :8000)")
    p.add_argument("--router-index", type=int, default=None, metavar="I",
                   help="the running cluster's router replica I (0-based; each replica has its own index)")

    def run(args: argparse.Namespace) -> int:
        from kvledger.launch.router_client import monitor
        return monitor(url=args.url, rank=args.rank, as_json=args.json, seconds=args.seconds,
                       router_index=args.router_index)
    return run


def _status(p: argparse.ArgumentParser) -> Run:
    p.add_argument("--json", action="store_true", help="print JSON")

    def run(args: argparse.Namespace) -> int:
        from kvledger.launch import up
        return up.status(as_json=args.json)
    return run


def _down(p: argparse.ArgumentParser) -> Run:
    def run(args: argparse.Namespace) -> int:
        from kvledger.launch import up
        return up.down()
    return run


_COMMANDS: dict[str, tuple[str, AddFlags] | None] = {
    "demo": ("walk through one rank's ledger: reuse, eviction, offload", _demo),
    "up": ("start a local Ray cluster (or join one) with one rank actor per GPU/slot", _up),
    "route": ("send one prompt through the router; print rank, cached tokens, output", _route),
    "monitor": ("watch the router's event stream and the ranks", _monitor),
    "bench": None,  # ``bench_cli.add_bench_parser`` adds its own sub-parser, help included
    "status": ("ranks, device, agreed block counts, blocks in use, alive", _status),
    "down": ("stop the cluster `kvledger up` started: its actors and the processes it started", _down),
}


def _parser(command: str | None) -> tuple[argparse.ArgumentParser, Run | None]:
    """The parser with every sub-command and the flags of ``command`` only; and ``command``'s action.

    ``bench``'s flags come from the replay library, which imports torch, so they are built only when it runs.
    """
    p = argparse.ArgumentParser(prog="kvledger", description="KV-cache coordinator for multi-GPU LLM serving")
    sub = p.add_subparsers(dest="command", required=True)
    run = None
    for name, spec in _COMMANDS.items():
        if spec is None:
            from kvledger.launch import bench_cli
            if name == command:
                bench_cli.add_bench_parser(sub)
                run = bench_cli.run_bench
            else:
                sub.add_parser(name, help=bench_cli.HELP)
            continue
        text, add_flags = spec
        parser = sub.add_parser(name, help=text, description=text)
        if name == command:
            run = add_flags(parser)
    return p, run


def main(argv: list[str] | None = None) -> int:
    from kvledger.coordinator.ray_env import configure
    configure()   # before anything imports ray: every command may start or join a cluster
    argv = sys.argv[1:] if argv is None else list(argv)
    # ``kvledger`` itself takes no option but --help, so the first other word is the sub-command
    command = next((a for a in argv if not a.startswith("-")), None)
    parser, run = _parser(command)
    args = parser.parse_args(argv)
    assert run is not None, f"argparse accepted sub-command {args.command!r}, which has no action"
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
