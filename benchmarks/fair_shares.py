"""Fair shares at the router's admission gate against the first-come-first-served gate it replaces.

The gate alone (``router.admission.AdmissionGate``), real threads: ``--slots``
slots, each completion holding its slot ``--service-ms``. A flooding tenant
sends ``--flood`` requests at once; ``--tenants`` others send ``--each``
requests apiece, one every ``--gap-ms``, starting as the flood lands. Printed
per discipline (``fair``, the baseline ``fifo``) and tenant: requests, mean
and p99 time to a slot, and its share of the slots while the flood still
queued; then the others' p99 wait, fifo over fair.

    python benchmarks/fair_shares.py [--slots 4] [--service-ms 20] [--flood 200] [--tenants 2] [--each 20]
"""
from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvledger.router.admission import AdmissionGate, Discipline
from kvledger.router.tenant_limits import TenantLimits
from kvledger.router.tenants import Caller

JOIN_S = 600.0


@dataclass(frozen=True, slots=True)
class TenantRun:
    tenant: str
    requests: int
    mean_wait_s: float
    p99_wait_s: float
    contended_share: float
    """Its share of the slots let go while the flood still had requests waiting."""


def run(discipline: Discipline, args: argparse.Namespace) -> list[TenantRun]:
    gate = AdmissionGate(args.slots, args.flood + args.tenants * args.each, JOIN_S, discipline)
    waits: dict[str, list[float]] = {}
    admitted: list[str] = []
    lock = threading.Lock()
    hold_s = args.service_ms / 1000

    def request(name: str) -> None:
        caller = Caller(name, "user", TenantLimits())
        t0 = time.perf_counter()
        held = gate.hold(caller, cost=1)
        waited = time.perf_counter() - t0
        with lock:
            waits.setdefault(name, []).append(waited)
            admitted.append(name)
        threading.Event().wait(hold_s)   # the completion on the ranks
        held.release()

    threads = [threading.Thread(target=request, args=("flood",)) for _ in range(args.flood)]
    for t in threads:
        t.start()
    for _ in range(args.each):
        for i in range(args.tenants):
            t = threading.Thread(target=request, args=(f"tenant{i}",))
            t.start()
            threads.append(t)
        threading.Event().wait(args.gap_ms / 1000)
    for t in threads:
        t.join(JOIN_S)
    last_flood = max(i for i, n in enumerate(admitted) if n == "flood")
    contended = admitted[:last_flood + 1]
    return [TenantRun(name, len(w), float(np.mean(w)), float(np.percentile(w, 99)),
                      contended.count(name) / len(contended)) for name, w in sorted(waits.items())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--service-ms", type=float, default=20.0)
    p.add_argument("--flood", type=int, default=200)
    p.add_argument("--tenants", type=int, default=2)
    p.add_argument("--each", type=int, default=20)
    p.add_argument("--gap-ms", type=float, default=25.0)
    args = p.parse_args()
    p99: dict[str, float] = {}
    for discipline in ("fair", "fifo"):
        print(f"{discipline}: {'tenant':>8} {'requests':>8} {'mean wait':>10} {'p99 wait':>9} {'contended share':>15}")
        runs = run(discipline, args)
        for r in runs:
            print(f"{'':5} {r.tenant:>8} {r.requests:>8} {r.mean_wait_s:>9.3f}s {r.p99_wait_s:>8.3f}s "
                  f"{r.contended_share:>15.2f}")
        p99[discipline] = max(r.p99_wait_s for r in runs if r.tenant != "flood")
    print(f"the other tenants' p99 wait: fifo {p99['fifo']:.3f} s, fair {p99['fair']:.3f} s, "
          f"fifo / fair {p99['fifo'] / p99['fair']:.1f}x")


if __name__ == "__main__":
    main()
