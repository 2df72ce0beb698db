"""The bundled workload: a few prompts sharing prefixes, routed to the rank that holds the most of each.

Routing here is the exact probe (longest cached prefix, ties round-robin) until
the router's policies are wired to the cluster. The last step pulls a shared
prefix to a rank that lacks it (a KV migration) instead of computing it again.
"""
from __future__ import annotations

from collections.abc import Callable

from coordinator.cluster import Cluster
from coordinator.migration import Migrator
from worker.tokenizer import decode, encode

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
MAX_NEW_TOKENS = 8


def run_bundled(cluster: Cluster, out: Callable[[str], None] = print) -> list[dict]:
    """Serve the bundled prompts one by one on the best-probing rank, then migrate a prefix; returns results."""
    results = []
    out(f"{'req':>3} {'rank':>4} {'cached':>6} {'computed':>8} {'probe per rank':<18} output")
    for i, text in enumerate(BUNDLED):
        tokens = encode(text)
        rank, matched = cluster.best_rank(tokens)
        (res,) = cluster.serve([{"request_id": i, "tokens": tokens, "max_new_tokens": MAX_NEW_TOKENS}], rank=rank,
                               logits="none")
        results.append(res)
        out(f"{i:>3} {res['rank']:>4} {res['cached_tokens']:>6} {res['computed_tokens']:>8} {str(matched):<18} "
            f"{decode(res['output_tokens'])!r}")
    if len(cluster.actors) > 1:
        tokens = encode(SYSTEM + DOCS + "Q: Where did this prefix come from?")
        matched = cluster.probe(tokens)
        src = max(range(len(matched)), key=lambda r: matched[r])
        dst = min(range(len(matched)), key=lambda r: matched[r])
        if src != dst and matched[src] > 0:
            m = Migrator(cluster).migrate(tokens, src=src, dst=dst)
            out(f"migrated {m.sent_blocks} blocks ({m.bytes} bytes) of a shared prefix from rank {src} to rank {dst} "
                f"in {m.seconds * 1e3:.1f} ms")
            (res,) = cluster.serve([{"request_id": len(BUNDLED), "tokens": tokens,
                                     "max_new_tokens": MAX_NEW_TOKENS}], rank=dst, logits="none")
            results.append(res)
            out(f"{len(BUNDLED):>3} {res['rank']:>4} {res['cached_tokens']:>6} {res['computed_tokens']:>8} "
                f"{str(cluster.probe(tokens)):<18} {decode(res['output_tokens'])!r}")
    cached = sum(r["cached_tokens"] for r in results)
    total = cached + sum(r["computed_tokens"] for r in results)
    out(f"{len(results)} requests, {cached} of {total} prompt tokens served from cache ({cached / total:.0%})")
    return results
