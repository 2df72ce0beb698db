"""``kvledger bench --engine vllm``: the trace replayed through real vLLM servers, one policy after another.

The servers are the ranks (``--vllm URL``, one rank each). For every policy the
servers' prefix caches are emptied (``POST /reset_prefix_cache``, which vLLM
serves only with ``VLLM_SERVER_DEV_MODE=1``; otherwise restart them between
policies) and a fresh router with that policy runs in this process, its HTTP
API on 127.0.0.1, subscribed to the servers' KV events; the trace goes through
it exactly as ``--engine tiny`` sends it (``replay.tiny.PolicyReplay``).

The workload is fitted to the servers' model: token ids are drawn below its
vocabulary (read from its tokenizer), prompts cut so that prompt and output fit
its maximum length (the servers must serve one model; their block sizes may
differ, the bounds are computed at the smallest).
Requests keep the trace's cache salts (vLLM isolates them, and names a salt in
its events' ``extra_keys``, which the index reads) and drop its LoRA ids (the
servers have no adapters loaded). Besides TTFT (the measured completion latency) and hit rate,
each policy reports the cached tokens the router predicted against those the
servers delivered.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

from kvledger.replay.bounds import compute_bounds, static_split_cached_tokens
from kvledger.replay.config import START_TIMEOUT_S, BenchConfig
from kvledger.replay.engine_totals import EngineTotals
from kvledger.replay.peers import Peer, PeerRouter, event_endpoint, parse_peers
from kvledger.replay.report import summarize
from kvledger.replay.result import BenchResult
from kvledger.replay.simulator import PolicyRun, SimConfig, check_fits, policy_options
from kvledger.replay.text_prompts import prompt_text
from kvledger.replay.tiny import PolicyReplay, _Answer, load_tiny_trace
from kvledger.replay.trace import BlockChains, Trace, expand_tokens
from kvledger.router.feed import FOREIGN_RANK_BASE
from kvledger.router.prompt_tokenizer import HfTokenizer
from kvledger.router.vllm_engine import VllmEngine
from kvledger.router.vllm_server import VllmServer


METRICS_TIMEOUT_S = 30.0
METRICS_SETTLE_S = 0.5
"""How long the servers' counters are given to take in a run's last answers."""
WARM_PROMPTS = 8
"""Trace prompts each server is sent before the first run (``warm_servers``)."""
HTTP_WARM_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True, slots=True)
class ServerFacts:
    """What the replay needs to know of the servers, which must agree on it."""

    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    """The smallest of the servers' (each is indexed at its own; the bounds are computed at this one)."""
    num_blocks: tuple[int, ...] = ()
    """Each server's KV blocks (``num_gpu_blocks``; 0 where it reports none)."""
    event_endpoints: tuple[str, ...] = ()
    """Each server's KV-event endpoint as a subscriber here reaches it (``replay.peers.event_endpoint``)."""


def server_facts(urls: tuple[str, ...]) -> ServerFacts:
    """Ask each server (``VllmServer.discover``); a ``ValueError`` names what they disagree on or lack."""
    facts, blocks, events = [], [], []
    for i, url in enumerate(urls):
        engines = VllmEngine.connect_all(FOREIGN_RANK_BASE + i, url)   # a data-parallel server's cores agree
        try:
            info = engines[0].info()
            tok = info.tokenizer
            if not info.block_size or info.max_context is None:
                raise ValueError(f"vLLM server {url} reports no block size or maximum model length")
            if not isinstance(tok, HfTokenizer):
                raise ValueError(f"vLLM server {url}: the bench draws token ids below the model's vocabulary and "
                                 f"reads it from the model's tokenizer.json, which is not readable here "
                                 f"(tokenized by {tok.name})")
            facts.append(ServerFacts(info.model, info.max_context, tok.vocab_size, info.block_size))
        finally:
            for engine in engines:
                engine.close()
        server = VllmServer(url)
        try:
            found = server.discover()
        finally:
            server.close()
        blocks.append(found.num_blocks or 0)
        events.append(event_endpoint(found))
    if len({(f.model, f.max_model_len, f.vocab_size) for f in facts}) > 1:
        raise ValueError(f"the vLLM servers serve different models (model, length or vocabulary): {facts}")
    return dataclasses.replace(facts[0], block_size=min(f.block_size for f in facts), num_blocks=tuple(blocks),
                               event_endpoints=tuple(events))


class VllmPolicyReplay(PolicyReplay):
    """One policy through the servers: a fresh in-process router, caches emptied, the trace over HTTP, and the
    servers' own counters read around it (``replay.engine_totals``)."""

    rank_base = FOREIGN_RANK_BASE

    def __init__(self, trace: Trace, tokens: list[list[int]] | list[str], policy: str, sim: SimConfig, options,
                 name: str, urls: tuple[str, ...], model: str) -> None:
        super().__init__(trace, tokens, policy, sim, options, name)
        self.urls = urls
        self.fields = {"model": model}

    @contextlib.contextmanager
    def _router(self) -> Iterator[str]:
        """kvledger's router with this policy, in this process, its HTTP API on 127.0.0.1: its URL."""
        from kvledger.router.array_index import warm_kernels
        from kvledger.router.config import RouterConfig
        from kvledger.router.http import HttpServer, make_app
        from kvledger.router.service import RouterService

        warm_kernels()   # as ``kvledger up``'s router does before it reports ready
        s = self.sim
        service = RouterService(None, RouterConfig(tokens_per_block=s.tokens_per_block, policy=self.policy,
                                                   seed=s.seed, vllm=self.urls,
                                                   policy_options=policy_options(self.policy, s, False)))
        try:
            http = HttpServer(make_app(service), port=0).start(START_TIMEOUT_S)
            try:
                yield http.url
            finally:
                http.stop()
        finally:
            service.close()

    def run(self, progress: Callable[[int], None] | None = None) -> tuple[PolicyRun, dict[str, object]]:
        import httpx

        wall0 = time.perf_counter()
        with self._router() as url, httpx.Client(timeout=METRICS_TIMEOUT_S) as client:
            for server_url in self.urls:
                server = VllmServer(server_url)
                try:
                    server.reset_prefix_cache()
                finally:
                    server.close()
            before = [EngineTotals.read(client, u) for u in self.urls]
            run, extra = self._replay(url, httpx, progress, time.perf_counter() - wall0, wall0)
            time.sleep(METRICS_SETTLE_S)
            totals = [EngineTotals.read(client, u).since(b) for u, b in zip(self.urls, before)]
        run.requests_per_rank = [round(t.requests) for t in totals]
        run.work_s = [t.busy_s for t in totals]
        prompt = sum(t.prompt_tokens for t in totals)
        extra["engines"] = [{"url": u, "requests": round(t.requests), "prompt_tokens": round(t.prompt_tokens),
                             "cached_tokens": round(t.cached_tokens), "busy_s": round(t.busy_s, 3)}
                            for u, t in zip(self.urls, totals)]
        extra["engine_hit_rate"] = sum(t.cached_tokens for t in totals) / prompt if prompt else 0.0
        return run, extra


class PeerPolicyReplay(VllmPolicyReplay):
    """The same, through a peer router (``replay.peers``): its answers carry no kvledger figures, so the rank of a
    request is unknown (the engines' counters split them) and its computed tokens are its prompt less its cached."""

    def __init__(self, trace: Trace, tokens: list[str], peer: Peer, sim: SimConfig, options, urls: tuple[str, ...],
                 model: str, events: list[str]) -> None:
        super().__init__(trace, tokens, peer.name, sim, options, peer.name, urls, model)
        self.peer, self.events = peer, events

    @contextlib.contextmanager
    def _router(self) -> Iterator[str]:
        router = PeerRouter(self.peer, list(self.urls), self.events, self.fields["model"], self.sim.tokens_per_block)
        try:
            yield router.url
        finally:
            router.close()

    def run(self, progress: Callable[[int], None] | None = None) -> tuple[PolicyRun, dict[str, object]]:
        replayed, extra = super().run(progress)
        replayed.load_series = []   # no rank per request: only the servers' counters split the work
        return replayed, extra

    def _answer(self, d: dict, sent: float, done: float) -> _Answer:
        u = d["usage"]
        prompt, cached = int(u["prompt_tokens"]), int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return _Answer(True, "", -1, prompt, cached, prompt - cached, output=int(u["completion_tokens"]), sent=sent,
                       done=done)


def warm_servers(urls: tuple[str, ...], model: str, prompts: list[list[int]] | list[str]) -> None:
    """Send each server ``prompts`` directly, one at a time, before the first run: a CPU server's first prompts of a
    length are slow (its kernels are set up per shape), and the first router measured must not pay for that alone.
    The caches are reset before every run anyway."""
    import httpx

    with httpx.Client(timeout=HTTP_WARM_TIMEOUT_S) as client:
        for url in urls:
            for prompt in prompts:
                client.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})


def run_vllm(config: BenchConfig, progress: Callable[[str, int], None] | None = None,
             on_trace: Callable[[Trace, list[str]], None] | None = None) -> BenchResult:
    """``runner.run`` for ``engine == "vllm"`` (see the module docstring)."""
    wall0 = time.perf_counter()
    urls = config.vllm
    facts = server_facts(urls)
    options = config.tiny
    fitted = dataclasses.replace(options, max_input_tokens=min(options.max_input_tokens,
                                                               facts.max_model_len - options.max_output_tokens))
    trace, tpb = load_tiny_trace(config.trace, config.limit, facts.block_size, config.seed, fitted)
    trace = Trace(trace.name, trace.block_size, [dataclasses.replace(r, lora_id=None) for r in trace.requests])
    chains_of = BlockChains(trace.block_size, tpb)
    chains = [chains_of.chain(r) for r in trace.requests]
    ranks = len(urls)
    sim = SimConfig(ranks=ranks, capacity_blocks=max(len(chains_of), 1) * ranks, tokens_per_block=tpb,
                    speed=config.speed, migration=False, seed=config.seed, policy_options=config.policy_options)
    check_fits(trace, sim)
    bounds = compute_bounds(chains, [r.input_length for r in trace.requests], tpb, sim.capacity_blocks)
    peers = parse_peers(config.peer)
    if peers:   # the peers take text only: every router gets the same text, one block's characters per trace block
        tokens: list[list[int]] | list[str] = [prompt_text(r.hash_ids, r.input_length, trace.block_size)
                                               for r in trace.requests]
    else:
        tokens = [expand_tokens(r.hash_ids, r.input_length, trace.block_size, vocab_size=facts.vocab_size)
                  for r in trace.requests]
    policies = config.policies
    if on_trace is not None:
        on_trace(trace, [*policies, *(p.name for p in peers)])
    warm_servers(urls, facts.model, tokens[:WARM_PROMPTS])
    runs: dict[str, PolicyRun] = {}
    extras: dict[str, dict[str, object]] = {}
    for p in policies:
        replay = VllmPolicyReplay(trace, tokens, p, sim, fitted, f"kvledger-bench-vllm-{p}", urls, facts.model)
        runs[p], extras[p] = replay.run((lambda k, p=p: progress(p, k)) if progress else None)
    for peer in peers:
        replay = PeerPolicyReplay(trace, tokens, peer, sim, fitted, urls, facts.model, list(facts.event_endpoints))
        runs[peer.name], extras[peer.name] = replay.run((lambda k, n=peer.name: progress(n, k)) if progress else None)
    summaries = {p: summarize(r, bounds, ranks) for p, r in runs.items()}
    capacities = list(facts.num_blocks) if all(facts.num_blocks) else []
    split = static_split_cached_tokens(chains, [r.input_length for r in trace.requests], tpb,
                                       capacities) if capacities else 0
    extra = {"vllm": {"servers": list(urls), "model": facts.model, "max_model_len": facts.max_model_len,
                      "vocab_size": facts.vocab_size, "max_input_tokens": fitted.max_input_tokens,
                      "max_output_tokens": fitted.max_output_tokens, "concurrency": fitted.concurrency,
                      "ttft": "measured completion latency from the scheduled arrival",
                      "capacity": "the servers' own KV pools (the bounds assume an unlimited cache)",
                      "prompts": "text, one block of characters per trace block" if peers else "token ids",
                      "static_split_hit_rate": split / bounds.prompt_tokens if bounds.prompt_tokens else 0.0,
                      "server_blocks": capacities, "peers": [p.name for p in peers],
                      "policies": extras}}
    return BenchResult(trace, sim, bounds, runs, summaries, time.perf_counter() - wall0, len(chains_of),
                       engine="vllm", extra=extra)


__all__ = ["ServerFacts", "run_vllm", "server_facts"]
