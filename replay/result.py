"""What one ``kvledger bench`` run produced: the trace, the bounds, every policy's replay and summary."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.replay.bounds import Bounds
from kvledger.replay.report import PolicySummary
from kvledger.replay.simulator import PolicyRun, SimConfig
from kvledger.replay.trace import Trace


@dataclass(slots=True)
class BenchResult:
    trace: Trace
    sim: SimConfig
    bounds: Bounds
    runs: dict[str, PolicyRun]
    summaries: dict[str, PolicySummary]
    wall_s: float
    unique_blocks: int
    engine: str = "sim"
    extra: dict[str, object] = field(default_factory=dict)
    """More fields for the JSON (the tiny engine's caps and per-policy failures, lags, start-up times)."""

    def meta(self) -> dict[str, object]:
        s = self.sim
        out: dict[str, object] = {
            "trace": self.trace.name, "ranks": s.ranks, "engine": self.engine, "requests": len(self.trace.requests),
            "capacity_blocks": s.capacity_blocks, "host_blocks": s.host_blocks,
            "tokens_per_block": s.tokens_per_block, "speed": s.speed, "seed": s.seed,
            "partial_reuse": s.partial_reuse, "migration": s.migration, "unique_blocks": self.unique_blocks}
        if self.engine == "sim":
            out["costs"] = {f: getattr(s.costs, f) for f in s.costs.__dataclass_fields__}
        out.update(self.extra)
        out["wall_s"] = round(self.wall_s, 3)
        return out
