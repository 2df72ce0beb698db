"""How long ``kvledger bench --engine tiny`` takes: a trace replayed over HTTP through real local clusters.

For every policy a fresh cluster starts (two rank actors with the reference
engine, the router actor on 127.0.0.1), the trace's requests leave at their
arrival times, and the cluster is torn down. What is printed per policy: the
start-up time, the replay's wall time against the trace's own span at that
speed (the baseline: a replay that keeps up with the trace takes its span;
ratio 1.00 = real time, above = the cluster fell behind), the latest a request
left after its scheduled arrival, and the whole run's wall time. This is the
measurement the suite's tiny-engine test used to assert as ``wall < 90``.

    python benchmarks/bench_replay.py [--requests 20] [--speed 4] [--policy kv,round_robin]
"""
from __future__ import annotations

import argparse
import time

from kvledger.coordinator.ray_env import configure
from kvledger.replay.config import BenchConfig
from kvledger.replay.runner import run


def main() -> None:
    configure()   # before the tiny engine's cluster imports ray
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--speed", type=float, default=4.0)
    p.add_argument("--policy", default="kv,round_robin")
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    t0 = time.perf_counter()
    result = run(BenchConfig(trace="synthetic", ranks=args.ranks, policy=args.policy, engine="tiny",
                             limit=args.requests, speed=args.speed, seed=0))
    wall = time.perf_counter() - t0
    reqs = result.trace.requests
    span = (reqs[-1].timestamp_s - reqs[0].timestamp_s) / args.speed if reqs else 0.0
    print(f"tiny replay: {len(reqs)} synthetic requests, {args.ranks} ranks, speed {args.speed:g}, "
          f"trace span {span:.2f} s")
    for name, extra in result.extra["tiny"]["policies"].items():
        replay = extra["replay_s"]
        ratio = replay / span if span > 0 else float("nan")
        print(f"  {name:<12} start-up {extra['startup_s']:6.2f} s  replay {replay:6.2f} s  "
              f"ratio to the trace span {ratio:5.2f} (1.00 = real time)  "
              f"latest send {extra['send_lag_max_s'] * 1e3:6.1f} ms after its arrival  "
              f"failed {extra['failed']}")
    print(f"  whole run {wall:.1f} s wall")


if __name__ == "__main__":
    main()
