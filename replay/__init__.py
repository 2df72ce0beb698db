"""``kvledger bench``: replay request traces through the real router and ledgers, every policy side by side.

``config`` (what to replay), ``result`` (what came out), ``trace`` (Mooncake loader, synthetic generator),
``workloads`` (the named ones), ``bounds`` (infinite-cache, pooled-LRU and static-split hit rates), ``simulator``
(the discrete-event replay), ``tiny`` and ``vllm`` (over HTTP through a local cluster or vLLM servers), ``peers``
(the routers people pick instead, beside ours), ``engine_totals`` (a server's own counters), ``text_prompts``,
``report`` (table, JSON, PNG) and ``runner`` (all of it, policies in parallel processes).
"""
from kvledger.replay.bounds import Bounds, compute_bounds
from kvledger.replay.config import BenchConfig
from kvledger.replay.result import BenchResult
from kvledger.replay.runner import run
from kvledger.replay.simulator import PolicyRun, SimConfig, SimCosts, simulate
from kvledger.replay.trace import SyntheticConfig, Trace, TraceRequest, generate_synthetic, load_mooncake

__all__ = ["BenchConfig", "BenchResult", "Bounds", "PolicyRun", "SimConfig", "SimCosts", "SyntheticConfig", "Trace",
           "TraceRequest", "compute_bounds", "generate_synthetic", "load_mooncake", "run", "simulate"]
