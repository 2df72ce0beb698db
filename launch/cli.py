"""``kvledger``: parses arguments and calls the library, nothing more."""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvledger", description="KV-cache coordinator for multi-GPU LLM serving")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="walk through one rank's ledger: reuse, eviction, offload")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from launch.demo import run_demo
        run_demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
