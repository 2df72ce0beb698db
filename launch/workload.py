"""The bundled workload: a few prompts sharing prefixes, sent through the router's HTTP API.

Each request goes where the router's policy says (``kv`` by default: the
rank that holds most of the prompt, unless it is loaded); the router probes its
index, built from the ranks' events, before each one. Then a shared prefix is
pulled to a rank that lacks it (a KV migration between ranks) and a request
for it is served there: the index now shows both ranks holding it.

The reference model's output is random-looking token ids, not text, so the
demo prints the ids, and for every request that was served from cached or
migrated blocks it checks what matters: the same prompt computed from scratch
(under a cache salt of its own, so nothing is reused) gives the same output.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.worker.engine.tokenizer import encode
from kvledger.worker.wire.request import Request

SYSTEM = "You are the kvledger demo assistant. Answer in one short sentence, plainly.\n"
DOCS = "Context: KV blocks are reused when prompts share a prefix; ranks agree on block counts.\n"
BUNDLED = [
    SYSTEM + "Q: What is a KV cache?",
    SYSTEM + "Q: Why share prompt prefixes?",
    SYSTEM + DOCS + "Q: What does the router do?",
    SYSTEM + DOCS + "Q: How do ranks agree on sizes?",
    SYSTEM + "Q: What is a KV cache? Explain again.",
    "An unrelated prompt that shares nothing with the others.",
]
MIGRATED = SYSTEM + DOCS + "Q: Where did this prefix come from?"
MAX_NEW_TOKENS = 8
TIMEOUT_S = 120.0
#: Cache salt of the from-scratch runs: no other request shares it, so nothing of theirs is reused.
SCRATCH_SALT = "kvledger-demo-from-scratch"


@dataclass(frozen=True, slots=True)
class DemoAnswer:
    """One bundled request as the demo saw it."""

    rank: int
    cached_tokens: int
    computed_tokens: int
    output_tokens: list[int]
    same_as_scratch: bool | None
    """Whether computing the prompt from scratch gave the same output (``None``: nothing was reused)."""


def _probe(client: httpx.Client, text: str) -> list[int]:
    r = client.post("/v1/probe", json={"prompt": text})
    r.raise_for_status()
    return [x["matched_tokens"] for x in r.json()["ranks"]]


def _complete(client: httpx.Client, text: str, salt: str | None = None) -> dict:
    body: dict = {"prompt": text, "max_tokens": MAX_NEW_TOKENS}
    if salt is not None:
        body["cache_salt"] = salt
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["kvledger"]


def _ids(tokens: list[int]) -> str:
    return " ".join(str(t) for t in tokens)


def _check(same: bool | None) -> str:
    return "-" if same is None else ("same" if same else "DIFFERENT")


def run_bundled(cluster: Cluster, router_url: str, out: Callable[[str], None] = print) -> list[DemoAnswer]:
    """Send the bundled prompts through the router at ``router_url``, then migrate a prefix; returns the answers."""
    results = []
    with httpx.Client(base_url=router_url, timeout=TIMEOUT_S) as client:
        out(f"{'req':>3} {'rank':>4} {'cached':>6} {'computed':>8} {'index probe':<18} {'vs scratch':<10} output ids")
        for i, text in enumerate(BUNDLED):
            probe = _probe(client, text)
            k = _complete(client, text)
            same = None
            if k["cached_tokens"]:
                same = _complete(client, text, SCRATCH_SALT)["output_token_ids"] == k["output_token_ids"]
            results.append(DemoAnswer(k["rank"], k["cached_tokens"], k["computed_tokens"], k["output_token_ids"],
                                      same))
            out(f"{i:>3} {k['rank']:>4} {k['cached_tokens']:>6} {k['computed_tokens']:>8} {str(probe):<18} "
                f"{_check(same):<10} {_ids(k['output_token_ids'])}")
        if len(cluster.actors) > 1:
            moved = _migrate_and_serve(cluster, client, out)
            if moved is not None:
                results.append(moved)
    cached = sum(r.cached_tokens for r in results)
    total = cached + sum(r.computed_tokens for r in results)
    checked = [r.same_as_scratch for r in results if r.same_as_scratch is not None]
    out(f"{len(results)} requests, {cached} of {total} prompt tokens served from cache ({cached / total:.0%}); "
        f"{sum(checked)} of {len(checked)} served from reused or migrated KV gave the output computed from scratch")
    return results


def _migrate_and_serve(cluster: Cluster, client: httpx.Client, out: Callable[[str], None]) -> DemoAnswer | None:
    """Pull MIGRATED's prefix to the rank holding least of it, serve it there, compare logits with from scratch."""
    tokens = encode(MIGRATED)
    matched = cluster.probe(tokens)
    src = max(range(len(matched)), key=lambda r: matched[r])
    dst = min(range(len(matched)), key=lambda r: matched[r])
    if src == dst or matched[src] <= 0:
        return None
    m = cluster.migrator.migrate(tokens, src=src, dst=dst)
    out(f"migrated {m.sent_blocks} blocks ({m.bytes} bytes) of a shared prefix from rank {src} to "
        f"rank {dst} in {m.seconds * 1e3:.1f} ms")
    (res,) = cluster.client(dst).serve([Request(len(BUNDLED), tokens, MAX_NEW_TOKENS)], logits=True).outcomes
    (scratch,) = cluster.client(src).serve([Request(len(BUNDLED) + 1, tokens, MAX_NEW_TOKENS,
                                                    cache_salt=SCRATCH_SALT)], logits=True).outcomes
    same = res.output_tokens == scratch.output_tokens and torch.allclose(
        torch.tensor(res.last_logits), torch.tensor(scratch.last_logits), atol=1e-4, rtol=1e-4)
    out(f"{len(BUNDLED):>3} {dst:>4} {res.cached_tokens:>6} {res.computed_tokens:>8} "
        f"{str(_probe(client, MIGRATED)):<18} {_check(same):<10} {_ids(res.output_tokens)}  "
        f"(on rank {dst}, from the migrated blocks; logits compared too)")
    return DemoAnswer(dst, res.cached_tokens, res.computed_tokens, res.output_tokens, same)
