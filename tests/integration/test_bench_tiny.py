"""``kvledger bench --engine tiny``: a synthetic trace replayed over HTTP through a real local cluster (two rank
actors with the reference engine, the router actor on 127.0.0.1), one fresh cluster per policy, times measured."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

import numpy as np
import pytest

from kvledger.launch.bench_cli import add_bench_parser, run_bench
from kvledger.replay import report
from kvledger.replay.config import BenchConfig, TinyOptions
from kvledger.replay.runner import run
from kvledger.replay.simulator import SimConfig
from kvledger.replay.tiny import PolicyReplay, fit_trace, load_tiny_trace, tiny_tokens
from kvledger.replay.trace import BlockChains, SyntheticConfig, generate_synthetic
from kvledger.worker.engine.tokenizer import VOCAB_SIZE

REQUESTS = 20
POLICIES = ("kv", "round_robin")


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvledger")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["bench", *argv])


# --- the workload, without a cluster --------------------------------------------------------------

def test_the_workload_fits_the_reference_model_and_keeps_the_trace_structure():
    trace, tpb = load_tiny_trace("synthetic", 60, None, 0, TinyOptions(max_input_tokens=256, max_output_tokens=4))
    assert tpb == 16 and len(trace.requests) == 60
    assert all(r.input_length <= 256 and r.output_length <= 4 for r in trace.requests)
    assert any(r.input_length == 256 for r in trace.requests), "the cut bites on some prompt"
    chains = BlockChains(trace.block_size, tpb)
    by_chain: dict[int, tuple[int, ...]] = {}
    for r in trace.requests:
        toks = tiny_tokens(trace, r)
        assert len(toks) == r.input_length and 0 <= min(toks) and max(toks) < VOCAB_SIZE
        assert toks == tiny_tokens(trace, r), "deterministic"
        for k, cid in enumerate(chains.chain(r)):   # equal block ids <=> equal tokens (and equal prefix)
            block = tuple(toks[k * tpb:(k + 1) * tpb])
            assert by_chain.setdefault(cid, block) == block
    full = generate_synthetic(SyntheticConfig(requests=10, block_size=16, seed=3))
    cut = fit_trace(full, 100, 2)
    for a, b in zip(full.requests, cut.requests):
        assert b.hash_ids == a.hash_ids[:len(b.hash_ids)] and len(b.hash_ids) == -(-b.input_length // 16)
        assert tiny_tokens(cut, b) == tiny_tokens(full, a)[:b.input_length]


@pytest.mark.parametrize("argv, message", [
    (("--engine", "nope"), "must be one of"),
    (("--engine", "tiny", "--policy", "kv,nope"), "unknown policy 'nope'"),
    (("--engine", "tiny", "--capacity-blocks", "1", "--ranks", "2"), "raise --capacity-blocks"),
])
def test_cli_rejects_bad_tiny_input_before_starting_anything(tmp_path, capsys, argv, message):
    rc = run_bench(parse("--limit", "5", "--quiet", "--json", str(tmp_path / "x.json"), *argv))
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "x.json").exists()


def test_no_migration_reaches_the_router_as_the_kv_policys_option():
    trace, _ = load_tiny_trace("synthetic", 5, None, 0, TinyOptions())
    sim = SimConfig(ranks=2, capacity_blocks=512, tokens_per_block=16, migration=False)
    for policy, options in (("kv", {"allow_migration": False}), ("round_robin", {})):
        rc = PolicyReplay(trace, [], policy, sim, TinyOptions(), "unused").router_config()
        assert rc.router.policy == policy and dict(rc.router.policy_options) == options
        assert rc.router.make_policy().name == policy
    with_migration = PolicyReplay(trace, [], "kv", SimConfig(ranks=2, capacity_blocks=512), TinyOptions(), "x")
    assert with_migration.router_config().router.make_policy().config.allow_migration
    given = dataclasses.replace(sim, policy_options={"kv": {"backlog_weight": 6}})   # --kv-backlog-weight 6
    rc = PolicyReplay(trace, [], "kv", given, TinyOptions(), "unused").router_config()
    assert dict(rc.router.policy_options) == {"allow_migration": False, "backlog_weight": 6}


# --- the replay on a real cluster -----------------------------------------------------------------

@pytest.fixture(scope="module")
def replayed(ray_session):
    # One request in flight at a time, in trace order: each is routed on the index every earlier answer left
    # (a completion's blocks are indexed before it answers), so the hit rates compared below are the same on
    # every run. With requests in flight together, which earlier ones had answered when the next was routed
    # would depend on the machine's speed.
    config = BenchConfig(trace="synthetic", ranks=2, policy=",".join(POLICIES), engine="tiny", limit=REQUESTS,
                         speed=4.0, seed=0, tiny=TinyOptions(concurrency=1))
    return run(config)


def test_every_request_is_answered_and_its_figures_add_up(replayed):
    result = replayed
    assert list(result.runs) == list(POLICIES)
    prompt = np.array([r.input_length for r in result.trace.requests])
    assert len(prompt) == REQUESTS
    for name, r in result.runs.items():
        extra = result.extra["tiny"]["policies"][name]
        assert extra["failed"] == 0, extra["errors"]
        assert len(r.ttft_s) == REQUESTS and (r.ttft_s > 0).all(), name
        assert (r.prompt_tokens == prompt).all(), f"{name}: the server saw the trace's prompts"
        assert (r.cached_tokens + r.computed_tokens == prompt).all(), name
        assert (r.cached_tokens >= 0).all() and (r.computed_tokens >= 1).all(), name
        assert set(r.rank.tolist()) <= {0, 1}
        assert result.summaries[name].requests == REQUESTS
        assert result.summaries[name].hit_rate <= result.bounds.infinite_hit_rate + 1e-12, name


def test_kv_hits_the_cache_at_least_as_often_as_round_robin(replayed):
    result = replayed
    kv, rr = result.summaries["kv"], result.summaries["round_robin"]
    assert kv.hit_rate >= rr.hit_rate, (kv.hit_rate, rr.hit_rate)
    assert kv.hit_rate > 0


def test_json_and_png_are_written(replayed, tmp_path):
    result = replayed
    out, png = tmp_path / "tiny.json", tmp_path / "tiny.png"
    report.write_json(out, report.to_json(result.meta(), result.bounds, result.summaries))
    report.write_plot(png, result.bounds, result.summaries, result.runs, "tiny", measured=True)
    doc = json.loads(out.read_text())
    assert doc["engine"] == "tiny" and doc["ranks"] == 2 and doc["requests"] == REQUESTS
    assert set(doc["bounds"]) >= {"infinite_hit_rate", "pooled_lru_hit_rate"}
    assert list(doc["policies"]) == list(POLICIES)
    for p in doc["policies"].values():
        assert {"hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_mean_s", "load_imbalance",
                "throughput_rps", "onboarded_blocks", "migrated_blocks", "requests"} <= set(p)
        assert p["requests"] == REQUESTS
    assert doc["tiny"]["max_input_tokens"] == 1024 and doc["tiny"]["vocab_size"] == VOCAB_SIZE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prefill_ranks_replay_each_policy_split_beside_whole_on_the_same_ranks(ray_session, capsys):
    """``--prefill-ranks 1``: kv whole, then kv with rank 0 only prefilling; every request answered, the split
    ones decoded on rank 1 from moved blocks, each run's phases printed with the split one's ratios."""
    rc = run_bench(parse("--engine", "tiny", "--trace", "docs", "--ranks", "2", "--prefill-ranks", "1",
                         "--split-mode", "always", "--min-split-tokens", "64", "--policy", "kv", "--limit", "8",
                         "--max-output-tokens", "4", "--quiet"))
    out = capsys.readouterr().out
    assert rc == 0, out
    split = re.search(r"kv P/D 1:1: split (\d+) requests, TTFT p50 [\d.]+ ms p99 [\d.]+ ms, inter-token p50 "
                      r"[\d.]+ ms p99 [\d.]+ ms, [\d.]+ output tokens/s, ([\d.]+) MiB moved", out)
    assert split is not None and int(split.group(1)) >= 7 and float(split.group(2)) > 0, out
    assert re.search(r"kv: split 0 requests", out) and "kv P/D 1:1 / whole: inter-token p99 " in out, out
    assert "failed" not in out, out


def test_prefill_ranks_need_the_tiny_engine_and_a_decode_rank():
    with pytest.raises(ValueError, match="--prefill-ranks 2 splits --engine tiny's own ranks"):
        BenchConfig(engine="tiny", ranks=2, tiny=TinyOptions(prefill_ranks=2))
    with pytest.raises(ValueError, match="it needs --engine tiny"):
        BenchConfig(engine="sim", tiny=TinyOptions(prefill_ranks=1))
