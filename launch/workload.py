"""The bundled workload: a few prompts sharing prefixes, sent through the router's HTTP API.

Each request goes where the router's policy says (``kv`` by default: the
rank that holds most of the prompt, unless it is loaded); the router probes its
index, built from the ranks' events, before each one. Then a shared prefix is
pulled to a rank that lacks it (a KV migration between ranks) and a request
for it is routed again: the index now shows both ranks holding it.
"""
from __future__ import annotations

from collections.abc import Callable

import httpx

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.migration import Migrator
from kvledger.worker.engine.tokenizer import decode, encode

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


def _probe(client: httpx.Client, text: str) -> list[int]:
    r = client.post("/v1/probe", json={"prompt": text})
    r.raise_for_status()
    return [x["matched_tokens"] for x in r.json()["ranks"]]


def _complete(client: httpx.Client, text: str, out: Callable[[str], None], i: int) -> dict:
    probe = _probe(client, text)
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": MAX_NEW_TOKENS})
    r.raise_for_status()
    body = r.json()
    k = body["kvledger"]
    out(f"{i:>3} {k['rank']:>4} {k['cached_tokens']:>6} {k['computed_tokens']:>8} {str(probe):<18} "
        f"{body['choices'][0]['text']!r}")
    return k


def run_bundled(cluster: Cluster, router_url: str, out: Callable[[str], None] = print) -> list[dict]:
    """Send the bundled prompts through the router at ``router_url``, then migrate a prefix; returns the answers."""
    results = []
    with httpx.Client(base_url=router_url, timeout=TIMEOUT_S) as client:
        out(f"{'req':>3} {'rank':>4} {'cached':>6} {'computed':>8} {'index probe':<18} output")
        for i, text in enumerate(BUNDLED):
            results.append(_complete(client, text, out, i))
        if len(cluster.actors) > 1:
            matched = cluster.probe(encode(MIGRATED))
            src = max(range(len(matched)), key=lambda r: matched[r])
            dst = min(range(len(matched)), key=lambda r: matched[r])
            if src != dst and matched[src] > 0:
                m = Migrator(cluster).migrate(encode(MIGRATED), src=src, dst=dst)
                out(f"migrated {m.sent_blocks} blocks ({m.bytes} bytes) of a shared prefix from rank {src} to "
                    f"rank {dst} in {m.seconds * 1e3:.1f} ms")
                (res,) = cluster.serve([{"request_id": len(BUNDLED), "tokens": encode(MIGRATED),
                                         "max_new_tokens": MAX_NEW_TOKENS}], rank=dst, logits="none")
                results.append(res)
                out(f"{len(BUNDLED):>3} {dst:>4} {res['cached_tokens']:>6} {res['computed_tokens']:>8} "
                    f"{str(_probe(client, MIGRATED)):<18} {decode(res['output_tokens'])!r}  (on rank {dst}, "
                    "from the migrated blocks)")
    cached = sum(r["cached_tokens"] for r in results)
    total = cached + sum(r["computed_tokens"] for r in results)
    out(f"{len(results)} requests, {cached} of {total} prompt tokens served from cache ({cached / total:.0%})")
    return results
