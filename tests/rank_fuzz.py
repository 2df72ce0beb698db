"""A differential fuzzer of one rank under pressure: every answer against the reference engine from scratch.

Each round builds a rank (``RankWorker``, no Ray) on a pool small enough to
force waiting and preemption, drawn from seeded choices: chunked prefill or
not, one full-attention window or a sliding window beside it, a host tier or
none, either capacity policy, drafting by prompt lookup or not. It then sends a handful of requests at once, each from a thread of its
own so they arrive in the order the threads run: prompts sharing a few
prefixes (so blocks are reused, offloaded and onboarded), greedy or seeded
sampling, some drafting tokens by prompt lookup, some searching beams. In
some rounds a migration's import takes blocks from under the running batch
for a moment and gives them back (``import_begin`` / ``import_abort``), which
forces preemption; a migration's export pins a stored prefix, onboarding it,
and reads it out (``export_begin`` / ``export_read``); a client's request is
aborted, queued or running (``abort``). Every output (every beam) is compared with the same request
served alone on a fresh ledger with room to spare and drafting nothing, and
the ledger's walking integrity check runs after every ledger call
(``CacheConfig.check_integrity``) and after the round.

    python tests/rank_fuzz.py --rounds 2000      # a long run: prints steps, requests, divergences
"""
from __future__ import annotations

import argparse
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.ledger import CacheConfig, KVCacheManager
from kvledger.worker.ledger.budget import blocks_to_completion
from kvledger.worker.rank.batch import BatchDriver, ServeResult
from kvledger.worker.rank.scheduler import CAPACITY_POLICIES, BatchingConfig
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.errors import OutOfBlocksError, RequestAbortedError
from kvledger.worker.wire.request import GREEDY, Request, Sampling

T = 4
WAIT_S = 120.0
PREFIXES = [[7] * 8, [7] * 4 + [9] * 4, list(range(1, 13)), [200, 201, 202]]


@dataclass(slots=True)
class FuzzReport:
    rounds: int = 0
    requests: int = 0
    steps: int = 0
    preempted: int = 0
    beam_searches: int = 0
    aborted: int = 0
    exported: int = 0
    drafted: int = 0
    accepted: int = 0
    divergences: list[str] = field(default_factory=list)
    integrity_errors: list[str] = field(default_factory=list)


def cache(rng: random.Random, blocks: int) -> CacheConfig:
    windowed = rng.random() < 0.4
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=blocks, num_secondary_blocks=rng.choice([0, 8]),
                       context_chunk_size=rng.choice([None, 8, 16]), check_integrity=True,
                       attention_windows=(8, None) if windowed else None, window_shares=(2, 1) if windowed else None)


def scratch(cfg: CacheConfig, r: Request) -> list[list[int]]:
    """``r``'s tokens alone on a fresh ledger with room to spare, drafting nothing (a beam search's every beam)."""
    res = scratch_result(cfg, r)
    return res.beams.tokens if res.beams is not None else [res.output_tokens]


def scratch_result(cfg: CacheConfig, r: Request) -> ServeResult:
    """``r`` alone on a fresh ledger of the same model (this module's geometry, ``cfg``'s windows) with room to
    spare and drafting nothing: its tokens, and its log-probabilities when ``r.sampling`` asks for them."""
    big = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=256, attention_windows=cfg.attention_windows)
    alone = Request(0, r.tokens, r.max_new_tokens, sampling=r.sampling, beam_width=r.beam_width)
    (res,) = BatchDriver(ReferenceEngine(big)).serve(KVCacheManager(big), [alone])
    return res


def requests(rng: random.Random, full_blocks: int, windowed: bool) -> list[Request]:
    """2 to 6 requests sharing prefixes, each small enough for the full-attention pool alone: greedy or seeded,
    some drafting by prompt lookup, and (one window only) some searching beams."""
    out = []
    for i in range(rng.randrange(2, 7)):
        tokens = rng.choice(PREFIXES) + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 10))]
        max_new = rng.randrange(1, 9)
        beams = 1 if windowed or rng.random() < 0.8 else rng.randrange(2, 4)
        drafts = 0 if beams > 1 or rng.random() < 0.6 else rng.randrange(1, 4)
        if blocks_to_completion(len(tokens), max_new, drafts, beams, T) > full_blocks:
            continue
        sampling = GREEDY if beams > 1 or rng.random() < 0.5 else Sampling(temperature=1.0, seed=rng.randrange(1000))
        out.append(Request(i + 1, tokens, max_new, sampling=sampling, num_draft_tokens=drafts, beam_width=beams))
    return out


def fuzz_round(seed: int, report: FuzzReport) -> None:
    rng = random.Random(seed)
    cfg = cache(rng, rng.randrange(5, 14))
    w = RankWorker(0, 1, cfg, batching=BatchingConfig(max_num_seqs=rng.choice([2, 4, 8]),
                                                      max_num_batched_tokens=rng.choice([8, 16, 64]),
                                                      capacity_policy=rng.choice(CAPACITY_POLICIES),
                                                      num_speculative_tokens=rng.choice([0, 0, 2])))
    w.build_ledger(*w.local_block_counts())
    full = min(s.max_num_blocks for s in w.manager.stats().windows if s.window is None)
    reqs = requests(rng, full, cfg.attention_windows is not None)
    got: dict[int, list[list[int]] | BaseException] = {}

    def send(r: Request) -> None:
        try:
            (out,) = w.serve([r]).outcomes
            got[r.request_id] = out.beams if out.beams is not None else [out.output_tokens]
            report.drafted += out.drafted_tokens
            report.accepted += out.accepted_tokens
        except BaseException as e:   # reported as a divergence, with the workload's seed
            got[r.request_id] = e

    def squat() -> None:
        """A migration target's import holds blocks a while, then is aborted."""
        for _ in range(3):
            time.sleep(rng_squat.uniform(0, 0.01))
            try:
                ticket = w.import_begin(rng_squat.choice(PREFIXES) + [255] * 12, rng_squat.randrange(1, 4))
            except OutOfBlocksError:   # no room now: the batch holds every block
                continue
            time.sleep(rng_squat.uniform(0, 0.01))
            w.import_abort(ticket.import_id)

    def export() -> None:
        """A migration source pins a stored prefix (onboarding it from the host tier), reads it and lets go."""
        for _ in range(3):
            time.sleep(rng_export.uniform(0, 0.01))
            try:
                ticket = w.export_begin(rng_export.choice(PREFIXES) + [1])
            except OutOfBlocksError:   # no room to onboard it now
                continue
            w.export_read(ticket.pin_id, 0)
            report.exported += ticket.blocks

    def abort() -> None:
        """A client goes away: its request is aborted wherever it is, queued or running."""
        time.sleep(rng_abort.uniform(0, 0.02))
        aborted.update(w.abort([rng_abort.choice(reqs).request_id]))

    rng_squat, rng_export, rng_abort = random.Random(seed + 1), random.Random(seed + 2), random.Random(seed + 3)
    aborted: set[int] = set()
    threads = [threading.Thread(target=send, args=(r,)) for r in reqs]
    if rng.random() < 0.5:
        threads.append(threading.Thread(target=squat))
    if rng.random() < 0.3:
        threads.append(threading.Thread(target=export))
    if reqs and rng.random() < 0.2:
        threads.append(threading.Thread(target=abort))
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    for r in reqs:
        if r.request_id in aborted and isinstance(got.get(r.request_id), RequestAbortedError):
            report.aborted += 1
            continue
        want = scratch(cfg, r)
        if got.get(r.request_id) != want:
            report.divergences.append(f"seed {seed}: request {r.request_id} ({len(r.tokens)} tokens, "
                                      f"{r.max_new_tokens} new, {r.beam_width} beams, {r.num_draft_tokens} "
                                      f"drafts) gave {got.get(r.request_id)!r}, scratch {want}")
    try:
        w.check_integrity()
    except Exception as e:
        report.integrity_errors.append(f"seed {seed}: {e}")
    load = w.load()
    report.rounds += 1
    report.requests += len(reqs)
    report.beam_searches += sum(1 for r in reqs if r.beam_width > 1)
    report.steps += load.steps
    report.preempted += load.preempted_requests


def fuzz(seeds: range) -> FuzzReport:
    report = FuzzReport()
    for seed in seeds:
        fuzz_round(seed, report)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--first-seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    r = fuzz(range(args.first_seed, args.first_seed + args.rounds))
    print(f"{r.rounds} rounds, {r.requests} requests ({r.beam_searches} beam searches; {r.drafted} draft tokens "
          f"checked, {r.accepted} accepted; {r.aborted} aborted), {r.exported} blocks exported, {r.steps} rank "
          f"steps, {r.preempted} preemptions in "
          f"{time.perf_counter() - t0:.0f} s: {len(r.divergences)} divergences, {len(r.integrity_errors)} integrity "
          "violations")
    for line in r.divergences[:20] + r.integrity_errors[:20]:
        print(" ", line)


if __name__ == "__main__":
    main()
