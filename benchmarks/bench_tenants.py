"""Many tenants on two real vLLM servers: agents in multi-turn tool-calling sessions, one tenant flooding.

Two vLLM 0.32 CPU servers with the tiny checkpoint, each on a core of its own and
with ``--num-gpu-blocks-override`` KV blocks of 32 tokens (the routing issue's
cache pressure), behind the kvledger router in a process of its own, with an
API-key file naming the tenants. Three runs of the same agents, the engines'
prefix caches reset before each:

- ``alone``: the agent tenants only (their TTFT when nobody floods);
- ``fifo``: a flooding tenant beside them, the router's admission first come,
  first served (``--admission fifo``);
- ``fair``: the same flood, weighted-fair admission with the tenants' weights
  and limits from the key file (``--admission fair``).

Each agent session keeps a growing conversation: a system prompt of its own (a
repository), the tools, and per turn a user message, the model's answer, then a
tool call and its result after a gap in which the tool runs; every turn goes
with ``x-session-id``. The flood sends distinct long prompts from many
connections at once, retrying a 429 after its ``Retry-After``; its key file line
holds it to its share (``FLOOD_LIMITS``, ``--flood-limits``). Printed per run
and tenant: completions, TTFT p50/p99 (first streamed chunk), shed (429s) and
the hit rate from the engines' own usage (cached / prompt tokens); per agent
run the share of each turn's reusable prefix (the previous turn's prompt in
whole blocks) that the engine served from cache. Then the agents' TTFT p99
under the flood over their p99 alone, for each admission.

    python benchmarks/bench_tenants.py [--engines vllm|own] [--turns 8] [--sessions 4] [--tenants 2] [--blocks 200]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO / "tests"))   # the real vLLM harness the suite uses
from vllm_engines import TOOL_CALLING, EngineSpec, VllmServer, own_cores, start_bench_servers  # noqa: E402

BLOCK = 32
#: What kvledger's own ranks serve.
OWN_MODEL = "kvledger-reference"
HTTP_TIMEOUT_S = 120.0
#: An agent's tools, as an SDK sends them (they are rendered into every prompt by the engine's template).
TOOLS = [{"type": "function", "function": {
    "name": name, "description": doc,
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name, doc in (("read_file", "Read a file of the repository"), ("run_tests", "Run the tests of a folder"))]
#: The flood's share in the key file: a quarter of the router's 8 slots, and about one agent tenant's own token
#: rate (two sessions of ~1,600-token turns every ~1.3 s, cost counted as prompt + max_tokens, cached or not).
#: Without the rate, fair admission is work-conserving: the flood takes every slot the agents leave idle in their
#: tool gaps, and its prefills and cache churn land on the agents' engines (the README has both measured).
FLOOD_LIMITS = "max_inflight=2 tokens_per_s=2000"
AGENT_MAX_TOKENS = 12
FLOOD_MAX_TOKENS = 8


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta"))
                    + str(rng.randrange(100)) for _ in range(n))


@dataclass
class Turn:
    tenant: str
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int
    """The previous turn's prompt in whole blocks (0 on a session's first turn): what the engine could reuse."""
    rank: int
    """The engine the router sent it to."""


@dataclass
class Tally:
    turns: list[Turn] = field(default_factory=list)
    shed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, turn: Turn) -> None:
        with self.lock:
            self.turns.append(turn)

    def count(self, what: dict[str, int], tenant: str) -> None:
        with self.lock:
            what[tenant] = what.get(tenant, 0) + 1


class Refused(Exception):
    def __init__(self, status: int, retry_after_s: float, text: str) -> None:
        super().__init__(f"{status}: {text}")
        self.status, self.retry_after_s = status, retry_after_s


def stream_chat(client: httpx.Client, key: str, body: dict, session: str | None) -> tuple[float, dict, str, int]:
    """One streamed chat through the router: seconds to its first chunk, its usage, its text, its engine."""
    headers = {"Authorization": f"Bearer {key}", **({"x-session-id": session} if session else {})}
    t0 = time.perf_counter()
    ttft, usage, text = None, {}, []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}},
                       headers=headers) as r:
        if r.status_code == 429:
            r.read()
            raise Refused(r.status_code, float(r.headers.get("retry-after", 1)), r.text[:200])
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"the router answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            if ev.get("choices"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(ev["choices"][0].get("delta", {}).get("content") or "")
            if ev.get("usage"):
                usage, rank = ev["usage"], ev["kvledger"]["rank"]
    if ttft is None or not usage:
        raise RuntimeError("the stream ended without a choice or its usage")
    return ttft, usage, "".join(text), rank


def cached_of(usage: dict) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def agent(client: httpx.Client, key: str, tenant: str, session: str, model: str, turns: int, gap_s: float,
          seed: int, tally: Tally, deadline: float, send_id: bool, tools: bool) -> None:
    """One session: a turn, a tool call and its result after ``gap_s``, the next turn; ``turns`` of them, each
    with ``x-session-id`` when ``send_id``. Without ``tools`` (kvledger's own ranks serve no tool calling) the
    call is the answer's text and its result a user message."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": f"Repository {session}:\n{words(rng, 40)}"}]
    reusable = 0
    for t in range(turns):
        messages.append({"role": "user", "content": f"Step {t}: {words(rng, 5)}"})
        body = {"model": model, "messages": messages, "max_tokens": AGENT_MAX_TOKENS, "temperature": 0.0,
                **({"tools": TOOLS} if tools else {})}
        for _ in range(100):   # bounded: a refused turn is retried after the router's Retry-After
            if time.monotonic() > deadline:
                return
            try:
                ttft, usage, text, rank = stream_chat(client, key, body, session if send_id else None)
                break
            except Refused as e:
                tally.count(tally.shed, tenant)
                time.sleep(min(e.retry_after_s, 1.0))
        else:
            tally.count(tally.failed, tenant)
            return
        prompt = int(usage.get("prompt_tokens") or 0)
        tally.add(Turn(tenant, ttft, prompt, cached_of(usage), reusable, rank))
        reusable = prompt // BLOCK * BLOCK
        call = {"id": f"call_{session}_{t}", "type": "function",
                "function": {"name": TOOLS[t % 2]["function"]["name"], "arguments": json.dumps({"path": f"src/{t}"})}}
        messages.append({"role": "assistant", "content": text, **({"tool_calls": [call]} if tools else {})})
        time.sleep(gap_s * rng.uniform(0.5, 1.5))   # the tool runs
        result = words(rng, 8)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result} if tools else
                        {"role": "user", "content": f"{call['function']['name']} says: {result}"})


def flood(client: httpx.Client, key: str, model: str, seed: int, tally: Tally, stop: threading.Event) -> None:
    """Distinct long prompts, back to back, a 429 retried after its ``Retry-After``."""
    rng = random.Random(seed)
    while not stop.is_set():
        body = {"model": model, "messages": [{"role": "user", "content": words(rng, 75)}],
                "max_tokens": FLOOD_MAX_TOKENS, "temperature": 0.0}
        try:
            ttft, usage, _, rank = stream_chat(client, key, body, None)
        except Refused as e:
            tally.count(tally.shed, "flood")
            stop.wait(min(e.retry_after_s, 1.0))
            continue
        except httpx.HTTPError:
            tally.count(tally.failed, "flood")
            continue
        tally.add(Turn("flood", ttft, int(usage.get("prompt_tokens") or 0), cached_of(usage), 0, rank))


# ---------------------------------------------------------------------------------------------- the router process

def serve_router(spec: dict) -> None:
    """The router alone, in this process (``--serve-router``): its port on stdout, serving until stdin closes."""
    from kvledger.router.config import RouterConfig
    from kvledger.router.http import HttpServer, make_app
    from kvledger.router.service import RouterService
    from kvledger.router.tenants import ApiKeys

    ranks = None
    if spec["own_blocks"]:
        import torch

        from kvledger.coordinator.local_cluster import LocalCluster
        from kvledger.worker.ledger import CacheConfig

        ranks = LocalCluster.build(2, CacheConfig(tokens_per_block=BLOCK, dtype=torch.float32,
                                                  num_primary_blocks=spec["own_blocks"]))
    service = RouterService(ranks, RouterConfig(**spec["config"]))
    server = HttpServer(make_app(service, ApiKeys.load(spec["keys"])), port=0).start()
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()
    service.close()


class Router:
    """The router process of one run, started over the engines and stopped by its own process id."""

    def __init__(self, config: dict, keys: Path, own_blocks: int) -> None:
        """``own_blocks``: the router fronts two kvledger ranks of its own process with that many blocks each."""
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-router",
                                      json.dumps({"config": config, "keys": str(keys), "own_blocks": own_blocks})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError(f"the router did not start (exit {self.proc.wait()})")
        self.url = f"http://127.0.0.1:{line.strip()}"

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------- runs

@dataclass(frozen=True)
class Setup:
    sessions: int
    turns: int
    gap_s: float
    flood: int
    tenants: int
    max_inflight: int
    flood_limits: str
    """The flood's limits in the key file (``max_inflight=2 tokens_per_s=2000``)."""


def write_keys(path: Path, setup: Setup) -> dict[str, str]:
    """The key file: an agent tenant per ``agents-i`` (weight 1) and the flood (weight 1, ``flood_limits``). The
    tenant -> key map back."""
    keys = {f"agents-{i}": f"sk-agents-{i}" for i in range(setup.tenants)} | {"flood": "sk-flood"}
    lines = [f"{k} {t} user weight=1" + (f" {setup.flood_limits}" if t == "flood" else "") for t, k in keys.items()]
    path.write_text("\n".join(lines) + "\n")
    return keys


@dataclass(frozen=True)
class Run:
    name: str
    admission: str
    flood: bool
    sessions: bool
    """Whether the agents send ``x-session-id``."""


RUNS = (Run("alone", "fair", False, True), Run("fifo", "fifo", True, True),
        Run("fair, no session ids", "fair", True, False), Run("fair", "fair", True, True))


@dataclass(frozen=True)
class Fleet:
    """The engines behind the router: vLLM servers (``urls``), or two kvledger ranks of ``own_blocks`` each."""

    model: str
    urls: tuple[str, ...] = ()
    own_blocks: int = 0


def run(spec: Run, fleet: Fleet, keys_file: Path, keys: dict[str, str], setup: Setup, seed: int) -> Tally:
    for url in fleet.urls:   # a fresh router's own ranks start empty
        httpx.post(f"{url}/reset_prefix_cache", timeout=HTTP_TIMEOUT_S).raise_for_status()
    config = {"tokens_per_block": BLOCK, "vllm": fleet.urls, "policy": "kv",
              "max_inflight_completions": setup.max_inflight, "max_queued_completions": 256, "queue_timeout_s": 60.0,
              "admission": spec.admission}
    router = Router(config, keys_file, fleet.own_blocks)
    model = fleet.model
    tally, stop = Tally(), threading.Event()
    deadline = time.monotonic() + 900
    try:
        with httpx.Client(base_url=router.url, timeout=HTTP_TIMEOUT_S,
                          limits=httpx.Limits(max_connections=setup.flood + setup.sessions + 4)) as client:
            # the router's first chat compiles the template and loads the tokenizer: not a turn to time
            stream_chat(client, keys["flood"], {"model": model, "messages": [{"role": "user", "content": "warm"}],
                                                "max_tokens": 1}, None)
            flooders = [threading.Thread(target=flood, args=(client, keys["flood"], model, seed * 1000 + i, tally,
                                                             stop), daemon=True)
                        for i in range(setup.flood if spec.flood else 0)]
            for t in flooders:
                t.start()
            time.sleep(1.0 if spec.flood else 0.0)   # the flood is under way before the agents start
            tenants = [f"agents-{i % setup.tenants}" for i in range(setup.sessions)]
            agents = [threading.Thread(target=agent, args=(
                client, keys[tenant], tenant, f"{RUNS.index(spec)}-s{i}", model, setup.turns, setup.gap_s,
                seed * 100 + i, tally, deadline, spec.sessions, not fleet.own_blocks), daemon=True)
                for i, tenant in enumerate(tenants)]
            for t in agents:
                t.start()
                time.sleep(0.2)   # sessions start staggered
            for t in agents:
                t.join(max(1.0, deadline - time.monotonic()))
            stop.set()
            for t in flooders:
                t.join(HTTP_TIMEOUT_S)
    finally:
        router.close()
    return tally


def start_servers(work: Path, blocks: int) -> list[VllmServer]:
    """Two servers on the tiny checkpoint, a core each, ``blocks`` KV blocks each, tool calling on."""
    return start_bench_servers(work, own_cores([EngineSpec(), EngineSpec()]),
                               (*TOOL_CALLING, "--num-gpu-blocks-override", str(blocks)), BLOCK)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def report(name: str, tally: Tally) -> dict[str, float]:
    """Print one run's table; the agents' TTFT p99 and prefix kept back."""
    print(f"\n{name}")
    print(f"  {'tenant':<10} {'completions':>11} {'TTFT p50':>9} {'p99':>8} {'shed':>6} {'hit rate':>9} "
          f"{'prefix kept':>12} {'per engine':>12}")
    tenants = sorted({t.tenant for t in tally.turns} | set(tally.shed))
    for tenant in tenants:
        turns = [t for t in tally.turns if t.tenant == tenant]
        ttft = [t.ttft_s for t in turns]
        prompt = sum(t.prompt_tokens for t in turns)
        hit = sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0
        later = [t for t in turns if t.reusable_tokens]
        kept = (sum(min(t.cached_tokens, t.reusable_tokens) for t in later) / sum(t.reusable_tokens for t in later)
                if later else float("nan"))
        engines = "/".join(str(sum(t.rank == r for t in turns)) for r in sorted({t.rank for t in tally.turns}))
        print(f"  {tenant:<10} {len(turns):>11} {pct(ttft, 50):>8.3f}s {pct(ttft, 99):>7.3f}s "
              f"{tally.shed.get(tenant, 0):>6} {hit:>8.1%} {kept:>11.1%} {engines:>12}"
              + (f"  ({tally.failed[tenant]} failed)" if tally.failed.get(tenant) else ""))
    agents = [t for t in tally.turns if t.tenant != "flood"]
    later = [t for t in agents if t.reusable_tokens]
    kept = sum(min(t.cached_tokens, t.reusable_tokens) for t in later) / max(1, sum(t.reusable_tokens for t in later))
    p99 = pct([t.ttft_s for t in agents], 99)
    print(f"  agents together: {len(agents)} turns, TTFT p50 {pct([t.ttft_s for t in agents], 50):.3f} s, "
          f"p99 {p99:.3f} s, prefix kept {kept:.1%} over {len(later)} later turns")
    return {"p99": p99, "kept": kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=4, help="agent sessions, spread over the agent tenants")
    ap.add_argument("--tenants", type=int, default=2, help="agent tenants")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--gap-s", type=float, default=1.0, help="mean seconds a tool runs between turns")
    ap.add_argument("--flood", type=int, default=None,
                    help="the flooding tenant's connections (default: 10x an agent tenant's sessions)")
    ap.add_argument("--blocks", type=int, default=200, help="KV blocks per engine (--num-gpu-blocks-override)")
    ap.add_argument("--max-inflight", type=int, default=8, help="the router's max_inflight_completions")
    ap.add_argument("--flood-limits", default=FLOOD_LIMITS,
                    help="the flood's limits in the key file (default: its share, '%(default)s')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", choices=("vllm", "own"), default="vllm",
                    help="behind the router: two vLLM servers, or two kvledger ranks in the router's process")
    ap.add_argument("--vllm", action="append", metavar="URL",
                    help="use these running servers (twice; started with VLLM_SERVER_DEV_MODE=1, which serves "
                         "/reset_prefix_cache) instead of starting two")
    ap.add_argument("--serve-router", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_router:
        serve_router(json.loads(args.serve_router))
        return
    per_tenant = -(-args.sessions // args.tenants)
    setup = Setup(args.sessions, args.turns, args.gap_s, args.flood or 10 * per_tenant, args.tenants,
                  args.max_inflight, args.flood_limits)
    engines = "two kvledger ranks (the reference engine)" if args.engines == "own" else "two vLLM servers"
    print(f"{engines}, {args.blocks} blocks of {BLOCK} tokens each; {setup.sessions} agent sessions of "
          f"{setup.turns} turns over {setup.tenants} tenants, tool gaps of {setup.gap_s:g} s on average; the flood "
          f"on {setup.flood} connections (10x an agent tenant's {per_tenant}); router max_inflight_completions "
          f"{setup.max_inflight}")
    with tempfile.TemporaryDirectory(prefix="kvledger-tenants-") as tmp:
        work = Path(tmp)
        servers = [] if args.vllm or args.engines == "own" else start_servers(work, args.blocks)
        try:
            if args.engines == "own":
                fleet = Fleet(OWN_MODEL, own_blocks=args.blocks)
            else:
                urls = tuple(args.vllm or [s.url for s in servers])
                fleet = Fleet(httpx.get(f"{urls[0]}/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]["id"], urls)
            keys_file = work / "keys.txt"
            keys = write_keys(keys_file, setup)
            got = {}
            for spec in RUNS:
                tally = run(spec, fleet, keys_file, keys, setup, args.seed)
                got[spec.name] = report(f"{spec.name}: " + ("agents alone" if not spec.flood else
                                                            f"with the flood, {spec.admission} admission")
                                        + ("" if spec.sessions else ", the agents send no session id"), tally)
        finally:
            for s in servers:
                s.stop()
    alone = got["alone"]["p99"]
    print("\nagents' TTFT p99 under the flood / alone (goal <= 1.5):")
    for name in (r.name for r in RUNS if r.flood):
        print(f"  {name}: {got[name]['p99']:.3f} s / {alone:.3f} s = {got[name]['p99'] / alone:.2f}x; "
              f"prefix kept {got[name]['kept']:.1%} (goal >= 95%)")


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    main()
