"""``kvledger``: parses arguments and calls the library, nothing more."""
from __future__ import annotations

import argparse
import sys

import kvledger.coordinator  # noqa: F401  (before anything imports ray: one auth mode, loopback-only local Ray)
from kvledger.coordinator.config import ClusterConfig
from kvledger.router.policies import policy_names
from kvledger.router.config import RouterConfig
from kvledger.router.service import parse_vllm_endpoint

_DEFAULTS = ClusterConfig()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvledger", description="KV-cache coordinator for multi-GPU LLM serving")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="walk through one rank's ledger: reuse, eviction, offload")

    up = sub.add_parser("up", help="start a local Ray cluster (or join one) with one rank actor per GPU/slot")
    up.add_argument("--ranks", type=int, default=_DEFAULTS.num_ranks, help="rank actors (default %(default)s)")
    up.add_argument("--device", choices=["auto", "cpu", "cuda"], default=_DEFAULTS.device,
                    help="cuda: one GPU per rank, NCCL; cpu: fractional CPUs, gloo; auto: cuda when the cluster "
                         "has a GPU per rank (default %(default)s)")
    up.add_argument("--address", default=None,
                    help="join this Ray cluster (e.g. one made with `ray start --head`) instead of starting one")
    up.add_argument("--detach", action="store_true",
                    help="return once the cluster is healthy; stop it later with `kvledger down`")
    up.add_argument("--workload", choices=["bundled"], default=None,
                    help="route the bundled workload through the cluster, print each request, then stop")
    up.add_argument("--cpus-per-rank", type=float, default=_DEFAULTS.num_cpus_per_rank,
                    help="CPUs each rank reserves on a CPU-only cluster (default %(default)s)")
    up.add_argument("--host", default="127.0.0.1", help="interface of the router's HTTP API (default %(default)s)")
    up.add_argument("--port", type=int, default=8000, help="port of the router's HTTP API (0: any free port; "
                                                            "default %(default)s)")
    up.add_argument("--no-router", action="store_true", help="start the ranks only (Python API)")
    up.add_argument("--vllm-events", action="append", default=[], metavar="TCP[,REPLAY]",
                    help="also index a real vLLM engine's KV events: its ZMQ publisher tcp://HOST:PORT, optionally "
                         "followed by ,tcp://HOST:REPLAY_PORT (repeatable)")
    up.add_argument("--policy", default=RouterConfig.policy, metavar="NAME",
                    help=f"routing policy: one of {', '.join(policy_names())} (default %(default)s)")

    route = sub.add_parser("route", help="send one prompt through the router; print rank, cached tokens, output")
    route.add_argument("prompt")
    route.add_argument("--url", default=None, help="router URL (default: the running cluster's, else :8000)")
    route.add_argument("--salt", default=None, help="cache salt: only prompts with the same salt share KV")
    route.add_argument("--max-tokens", type=int, default=16)

    mon = sub.add_parser("monitor", help="watch the router's event stream and the ranks")
    mon.add_argument("--rank", type=int, default=None)
    mon.add_argument("--json", action="store_true", help="newline-delimited JSON events")
    mon.add_argument("--seconds", type=float, default=None, help="stop after this long (default: Ctrl-C)")
    mon.add_argument("--url", default=None)

    try:
        from kvledger.launch.bench_cli import add_bench_parser
    except ImportError:  # the bench comes with the router's issue
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)

    st = sub.add_parser("status", help="ranks, device, agreed block counts, blocks in use, alive")
    st.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("down", help="stop the cluster `kvledger up` started: its actors and the processes it started")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from kvledger.launch.demo import run_demo
        run_demo()
        return 0
    if args.command == "up":
        if args.ranks < 1:
            print("kvledger up: --ranks must be >= 1", file=sys.stderr)
            return 2
        if args.detach and args.workload:
            print("kvledger up: --workload runs and stops; it cannot be combined with --detach", file=sys.stderr)
            return 2
        from kvledger.launch import up
        if args.detach:
            rest = [a for a in argv[argv.index("up") + 1:] if a != "--detach"]
            return up.up_detached(rest)
        if not 0 <= args.port <= 65535:
            print("kvledger up: --port must be in 0..65535", file=sys.stderr)
            return 2
        config = ClusterConfig(num_ranks=args.ranks, device=args.device, num_cpus_per_rank=args.cpus_per_rank,
                               detached=args.address is not None or args.workload is None)
        try:
            for spec in args.vllm_events:
                parse_vllm_endpoint(spec)
        except ValueError as e:
            print(f"kvledger up: --vllm-events: {e}", file=sys.stderr)
            return 2
        if args.policy not in policy_names():
            print(f"kvledger up: unknown --policy {args.policy!r}; choose one of {', '.join(policy_names())}",
                  file=sys.stderr)
            return 2
        return up.up(config, address=args.address, workload=args.workload, router=not args.no_router,
                     host=args.host, port=args.port, policy=args.policy, vllm_events=args.vllm_events)
    if args.command == "route":
        from kvledger.launch.router_client import route
        return route(args.prompt, url=args.url, salt=args.salt, max_tokens=args.max_tokens)
    if args.command == "monitor":
        from kvledger.launch.router_client import monitor
        return monitor(url=args.url, rank=args.rank, as_json=args.json, seconds=args.seconds)
    if args.command == "bench":
        from kvledger.launch.bench_cli import run_bench
        return run_bench(args)
    if args.command == "status":
        from kvledger.launch import up
        return up.status(as_json=args.json)
    if args.command == "down":
        from kvledger.launch import up
        return up.down()
    return 2


if __name__ == "__main__":
    sys.exit(main())
