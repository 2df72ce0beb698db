"""``kvledger bench --engine sim``: the replay through the real router and ledgers, its bounds, its outputs."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from kvledger.launch.bench_cli import add_bench_parser, run_bench
from kvledger.replay.bounds import compute_bounds, infinite_cached_tokens, pooled_lru_cached_tokens
from kvledger.replay.config import BenchConfig
from kvledger.replay.replicas import replica_counts
from kvledger.replay.runner import run
from kvledger.replay.simulator import RouteHasher, SimConfig, SimCosts, Simulator, check_fits, simulate
from kvledger.replay.trace import (BlockChains, SyntheticConfig, Trace, TraceRequest, expand_tokens, generate_synthetic,
                                   load_mooncake, request_tokens, write_trace)
from kvledger.router.policies import KvCostModel, policy_names
from kvledger.router.probe import prompt_hashes

# The head of Mooncake's conversation trace, shipped with the tests (see tests/data/README.md).
MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head150.jsonl"
TPB = 32
SMALL = dict(trace="synthetic", ranks=4, tokens_per_block=TPB, limit=300, capacity_blocks=1600, seed=0)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvledger")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["bench", *argv])


@pytest.fixture(scope="module")
def result():
    """Every policy on one small synthetic trace, in two processes (the parallel path)."""
    return run(BenchConfig(policy="all", jobs=2, **SMALL))


def test_the_trace_flag_names_every_workload():
    """``--trace``'s metavar is written out (the CLI does not import the workloads, which pull in torch): it must
    name each of them."""
    from kvledger.replay.workloads import WORKLOADS
    p = argparse.ArgumentParser(prog="kvledger")
    sub = p.add_subparsers(dest="command", required=True)
    bench = add_bench_parser(sub)
    metavar, = (a.metavar for a in bench._actions if "--trace" in a.option_strings)
    assert set(metavar.split("|")) == {"FILE", "synthetic", *WORKLOADS}


# --- the replay -----------------------------------------------------------------------------------

def test_every_policy_runs_every_request(result):
    assert list(result.runs) == policy_names()
    n = len(result.trace.requests)
    for name, run_ in result.runs.items():
        assert len(run_.ttft_s) == n, name
        assert (run_.ttft_s > 0).all(), f"{name}: a request never got its first token"
        assert (run_.e2e_s >= run_.ttft_s).all(), name
        assert result.summaries[name].requests == n


def test_cached_plus_computed_is_the_prompt_for_every_request(result):
    prompt = np.array([r.input_length for r in result.trace.requests])
    for name, run_ in result.runs.items():
        assert (run_.cached_tokens + run_.computed_tokens == prompt).all(), name
        assert (run_.cached_tokens >= 0).all() and (run_.cached_tokens < prompt).all(), name
        assert (run_.cached_tokens % TPB == 0).all(), f"{name}: block granularity (partial reuse is off)"


def test_hit_rate_never_above_the_infinite_cache_bound(result):
    b = result.bounds
    assert 0 < b.pooled_lru_hit_rate <= b.infinite_hit_rate < 1
    for name, s in result.summaries.items():
        assert s.hit_rate <= b.infinite_hit_rate + 1e-12, name
        assert s.cached_tokens + s.computed_tokens == s.prompt_tokens == b.prompt_tokens


def test_kv_beats_round_robin_on_hit_rate(result):
    s = result.summaries
    assert s["kv"].hit_rate > s["round_robin"].hit_rate


def test_load_figures_are_consistent(result):
    for name, s in result.summaries.items():
        assert s.load_imbalance >= 1.0 - 1e-9, name
        assert sum(s.requests_per_rank) == s.requests
        assert math.isclose(max(s.work_per_rank_s) / (sum(s.work_per_rank_s) / len(s.work_per_rank_s)),
                            s.load_imbalance, rel_tol=1e-3)
        assert s.throughput_rps > 0 and s.ttft_p50_s <= s.ttft_p90_s <= s.ttft_p99_s
    assert result.summaries["round_robin"].requests_per_rank == [75, 75, 75, 75]
    assert all(s.migrated_blocks == 0 for n, s in result.summaries.items() if n != "kv")


def test_parallel_and_sequential_replays_agree(result):
    trace, sim = result.trace, result.sim
    again = simulate(trace, "kv", sim)
    first = result.runs["kv"]
    assert (again.cached_tokens == first.cached_tokens).all()
    assert np.allclose(again.ttft_s, first.ttft_s)
    assert again.migrated_blocks == first.migrated_blocks


def test_requests_wait_for_blocks_and_are_never_lost():
    """Capacity for barely more than one request per rank: the queues wait, everything is served."""
    trace = generate_synthetic(SyntheticConfig(requests=60, block_size=16, seed=3))
    need = max(-(-(r.input_length + r.output_length) // 16) for r in trace.requests)
    sim = SimConfig(ranks=2, capacity_blocks=2 * need, tokens_per_block=16)
    roomy = SimConfig(ranks=2, capacity_blocks=200 * need, tokens_per_block=16)
    tight, loose = simulate(trace, "round_robin", sim), simulate(trace, "round_robin", roomy)
    assert len(tight.ttft_s) == 60 and (tight.ttft_s > 0).all()
    assert tight.ttft_s.mean() > loose.ttft_s.mean()
    with pytest.raises(ValueError, match="more than a rank holds"):
        check_fits(trace, SimConfig(ranks=2, capacity_blocks=2 * need - 2, tokens_per_block=16))


def test_kv_migrates_prefixes_and_the_ledgers_stay_balanced():
    """Prefill is the bottleneck (fast decode, slow prefill): kv pulls hot prefixes to idle ranks."""
    trace = generate_synthetic(SyntheticConfig(requests=200, block_size=16, seed=1, conversations_per_s=4.0))
    sim = SimConfig(ranks=4, capacity_blocks=4000, tokens_per_block=16,
                    costs=SimCosts(prefill_tokens_per_s=5_000.0, decode_s_per_token=0.001))
    on = simulate(trace, "kv", sim)   # run() checks every ledger's integrity and the index at the end
    assert on.migrated_blocks > 0 and on.migrations > 0
    off = simulate(trace, "kv", dataclasses.replace(sim, migration=False))
    assert off.migrated_blocks == 0


# --- hashing, identities, bounds ---------------------------------------------------------------------

@pytest.mark.parametrize("tpb", [16, 24, 64, 100])
def test_route_hashes_are_the_routers_prompt_hashes(tpb):
    trace = generate_synthetic(SyntheticConfig(requests=40, block_size=64, seed=5))
    chains = BlockChains(trace.block_size, tpb)
    hasher = RouteHasher(tpb)
    for req in trace.requests:
        tokens = request_tokens(trace, req)
        want = prompt_hashes(tokens, tpb, lora_id=req.lora_id, cache_salt=req.cache_salt)
        assert list(hasher.hashes(req, tokens, chains.chain(req))) == want


def test_block_identities_follow_content_prefix_and_tenant():
    a = TraceRequest(0.0, 100, 1, (7, 8, 9, 10))           # block size 32: 4 ids, last cut to 4 tokens
    b = TraceRequest(0.0, 128, 1, (7, 8, 9, 10))           # same ids, last block full
    c = TraceRequest(0.0, 128, 1, (7, 8, 9, 10), cache_salt="other")
    d = TraceRequest(0.0, 128, 1, (7, 8, 99, 10))
    chains = BlockChains(32, 16)
    ca, cb, cc, cd = (chains.chain(r) for r in (a, b, c, d))
    assert len(ca) == 100 // 16 and cb[:len(ca)] == ca
    assert not set(cc) & set(cb), "a cache salt never shares blocks"
    assert cd[:4] == cb[:4] and not set(cd[4:]) & set(cb[4:]), "a different block changes every block after it"
    ta, tb = expand_tokens(a.hash_ids, 100, 32), expand_tokens(b.hash_ids, 128, 32)
    assert len(ta) == 100 and tb[:100] == ta, "a cut block is a prefix of the same id's full block"
    assert expand_tokens((7,), 32, 32) == tb[:32]


def test_bounds_by_hand():
    # blocks of 1 token; prompts of n tokens reuse at most n-1
    chains = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]]
    lengths = [3, 3, 1, 3]
    assert infinite_cached_tokens(chains, lengths, 1) == 0 + 2 + 0 + 2
    assert pooled_lru_cached_tokens(chains, lengths, 1, capacity_blocks=3) == 0 + 2 + 0 + 2
    # capacity 2: after request 2 the LRU holds [1, 2]; [5] evicts 2 (the tail went in first)
    assert pooled_lru_cached_tokens(chains, lengths, 1, capacity_blocks=2) == 0 + 2 + 0 + 1
    b = compute_bounds(chains, lengths, 1, 2)
    assert b.infinite_hit_rate == 4 / 10 and b.pooled_lru_hit_rate == 3 / 10


# --- the trace loader -------------------------------------------------------------------------------

def test_loader_rejects_bad_lines_naming_them(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: 1 hash_ids for input_length 600"):
        load_mooncake(p)
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1], "cache_salt": 3}\n')
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        load_mooncake(p)
    p.write_text("not json\n")
    with pytest.raises(ValueError, match="t.jsonl:1: not JSON"):
        load_mooncake(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_mooncake(tmp_path / "missing.jsonl")


def test_written_synthetic_trace_reloads_with_salts_and_loras(tmp_path):
    trace = generate_synthetic(SyntheticConfig(requests=50, block_size=512, seed=2))
    write_trace(trace, tmp_path / "s.jsonl")
    again = load_mooncake(tmp_path / "s.jsonl")
    assert [(r.hash_ids, r.cache_salt, r.lora_id, r.input_length) for r in again.requests] == \
        [(r.hash_ids, r.cache_salt, r.lora_id, r.input_length) for r in trace.requests]
    assert {r.cache_salt for r in trace.requests} >= {"tenant-0", "tenant-1"}
    assert any(r.lora_id is not None for r in trace.requests)


# --- router replicas ------------------------------------------------------------------------------------

REPLICAS = dict(event_lag_s=0.005, load_report_s=1.0)


@pytest.fixture(scope="module")
def replicas():
    """kv (one index per replica, fed by the ranks' events) and cache_aware (each replica's own guess of what
    the ranks hold, as SGLang's gateway keeps it) with 1 and 4 replicas on one trace."""
    trace = generate_synthetic(SyntheticConfig(requests=400, block_size=TPB, seed=1))
    bc = BlockChains(trace.block_size, TPB)
    chains = [bc.chain(r) for r in trace.requests]
    return {(policy, n): simulate(trace, policy, SimConfig(ranks=4, capacity_blocks=3200, tokens_per_block=TPB,
                                                           routers=n, **REPLICAS), chains=chains)
            for policy in ("kv", "cache_aware") for n in (1, 4)}


def test_routing_precision_holds_with_replicas_that_share_the_event_streams(replicas):
    one, four = replicas["kv", 1], replicas["kv", 4]
    assert four.routers == 4 and 0 < four.held_prefix <= len(four.ttft_s)
    assert four.routing_precision == four.to_longest / four.held_prefix
    assert four.routing_precision >= 0.9 and four.routing_precision >= one.routing_precision - 0.05
    hit = {n: replicas["kv", n].cached_tokens.sum() / replicas["kv", n].prompt_tokens.sum() for n in (1, 4)}
    assert hit[4] >= 0.95 * hit[1], hit


def test_replicas_that_only_guess_what_the_ranks_hold_lose_precision(replicas):
    one, four = replicas["cache_aware", 1], replicas["cache_aware", 4]
    assert four.routing_precision < one.routing_precision - 0.1, (one.routing_precision, four.routing_precision)
    assert four.routing_precision < replicas["kv", 4].routing_precision


def test_late_events_still_leave_every_replica_index_equal_to_the_ledgers():
    """Batches 50 ms late at three replicas: decisions are made on stale indexes, nothing is lost, and once
    the late batches land every replica's index holds what each ledger holds (``Simulator.run`` checks it)."""
    trace = generate_synthetic(SyntheticConfig(requests=150, block_size=TPB, seed=2))
    sim = SimConfig(ranks=2, capacity_blocks=1200, tokens_per_block=TPB, routers=3, event_lag_s=0.05,
                    load_report_s=0.2)
    run_ = simulate(trace, "kv", sim)
    prompt = np.array([r.input_length for r in trace.requests])
    assert (run_.cached_tokens + run_.computed_tokens == prompt).all() and (run_.ttft_s > 0).all()
    assert run_.routers == 3 and 0 < run_.to_longest <= run_.held_prefix <= len(prompt)
    with pytest.raises(ValueError, match="routers must be a positive int"):
        SimConfig(routers=0)
    with pytest.raises(ValueError, match="event_lag_s must be a finite number >= 0"):
        SimConfig(event_lag_s=-1.0)


def test_replica_counts_double_up_to_n():
    assert [replica_counts(n) for n in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]


def test_cli_compares_replica_counts_against_one_router(tmp_path, capsys):
    out = tmp_path / "replicas.json"
    rc = run_bench(parse("--limit", "120", "--tokens-per-block", "32", "--ranks", "2", "--capacity-blocks", "400",
                         "--policy", "kv,cache_aware", "--routers", "2", "--jobs", "1", "--quiet", "--json", str(out)))
    assert rc == 0
    text = capsys.readouterr().out
    assert "router replicas" in text and "precision" in text and "x1.00" in text and "longest one" in text
    doc = json.loads(out.read_text())["replicas"]
    assert list(doc["runs"]) == ["1", "2"] and doc["event_lag_s"] == 0.005 and doc["load_report_s"] == 1.0
    for n in ("1", "2"):
        assert set(doc["runs"][n]) == {"kv", "cache_aware"}
        assert 0 < doc["runs"][n]["kv"]["routing_precision"] <= 1


# --- the command line ---------------------------------------------------------------------------------

def test_cli_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = run_bench(parse("--trace", "synthetic", "--limit", "120", "--tokens-per-block", "32", "--ranks", "2",
                         "--capacity-blocks", "400", "--policy", "all", "--jobs", "1", "--quiet",
                         "--json", str(out), "--plot", str(png)))
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and doc["trace"].startswith("synthetic")
    assert set(doc["bounds"]) >= {"infinite_hit_rate", "pooled_lru_hit_rate"}
    assert list(doc["policies"]) == policy_names()
    keys = {"hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_mean_s", "load_imbalance",
            "throughput_rps", "onboarded_blocks", "migrated_blocks", "requests"}
    for name, p in doc["policies"].items():
        assert keys <= set(p), name
        assert p["requests"] == 120
        assert p["hit_rate"] <= doc["bounds"]["infinite_hit_rate"] + 1e-12
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = capsys.readouterr().out
    assert "round_robin" in text and "pooled LRU" in text


@pytest.mark.parametrize("argv, message", [
    (("--engine", "nope"), "must be one of"),
    (("--policy", "nope"), "unknown policy 'nope'"),
    (("--trace", "/nonexistent/trace.jsonl"), "does not exist"),
    (("--plot", "/nonexistent/dir/x.png"), "does not exist"),
    (("--plot", "x.svg"), "PNG"),
    (("--capacity-blocks", "1", "--ranks", "4"), "raise --capacity-blocks"),
    (("--decode-s-per-token", "-1"), "decode_s_per_token"),
    (("--engine", "tiny", "--routers", "2"), r"--routers 2 is measured in the simulator \(--engine sim\)"),
    (("--engine", "tiny", "--slowdown", "3"), r"--slowdown slows simulated ranks: it needs --engine sim"),
    (("--ranks", "2", *("--slowdown", "2") * 3), r"slowdown must be a tuple of at most 2"),
    (("--slowdown", "0.5"), r"finite numbers >= 1"),
    (("--policy", "cache_aware", "--kv-backlog-weight", "6"),
     r"--kv-backlog-weight: option\(s\) of policy 'kv', but the policy is 'cache_aware' \(--policy kv to use them\)"),
    (("--policy", "kv,round_robin", "--cache-aware-cache-threshold", "0.5"),
     r"option\(s\) of policy 'cache_aware', but the policies are 'kv', 'round_robin'"),
    (("--policy", "kv", "--kv-backlog-weight", "-1"), r"--kv-backlog-weight: backlog_weight must be a finite number"),
])
def test_cli_rejects_bad_input_clearly(tmp_path, capsys, argv, message):
    rc = run_bench(parse("--limit", "20", "--quiet", "--json", str(tmp_path / "x.json"), *argv))
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "x.json").exists()


def test_cli_parser_rejects_malformed_numbers():
    with pytest.raises(SystemExit):
        parse("--ranks", "0")
    with pytest.raises(SystemExit):
        parse("--speed", "fast")


#: Every flag ``kvledger bench`` took when its flags were written by hand, before they were built from the configs.
HAND_WRITTEN_FLAGS = ("--trace", "--ranks", "--policy", "--capacity-blocks", "--host-blocks", "--tokens-per-block",
                      "--engine", "--vllm", "--speed", "--limit", "--seed", "--json", "--plot", "--jobs",
                      "--partial-reuse", "--no-migration", "--quiet", "--max-input-tokens", "--max-output-tokens",
                      "--concurrency", "--routers", "--event-lag-s", "--load-report-s")


def test_bench_help_lists_every_config_field_with_its_docstring(capsys):
    from kvledger.launch.bench_cli import Outputs, RankBlocks
    from kvledger.launch.cli import main
    from kvledger.launch.flags import attribute_docs
    from kvledger.replay.config import TinyOptions

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = "".join(capsys.readouterr().out.split())   # argparse wraps the help (at hyphens too): compare unspaced
    # their own groups; per rank in RankBlocks; each policy's fields as its own flags (below)
    nested = {"costs", "tiny", "capacity_blocks", "host_blocks", "policy_options"}
    for cls in (BenchConfig, SimCosts, TinyOptions, RankBlocks, Outputs):
        docs = attribute_docs(cls)
        for f in dataclasses.fields(cls):
            if cls is BenchConfig and f.name in nested:
                continue
            assert f"--{f.name.replace('_', '-')}" in out, f"{cls.__name__}.{f.name} has no flag"
            doc = "".join(docs[f.name].replace("``", "`").split())
            assert doc in out, f"{cls.__name__}.{f.name}'s help is not its docstring"
    for flag in HAND_WRITTEN_FLAGS:
        assert flag in out
    for f in dataclasses.fields(KvCostModel):
        assert f"--kv-{f.name.replace('_', '-')}" in out, f"KvCostModel.{f.name} has no flag"


def test_bench_flags_keep_their_defaults_and_meanings():
    def config(*argv: str) -> BenchConfig:
        args = parse(*argv)
        return args.bench_flags.configs(args)[0]

    assert config() == BenchConfig()   # one router: no replica delays
    assert config("--routers", "4") == BenchConfig(routers=4, event_lag_s=0.005, load_report_s=1.0)
    got = config("--ranks", "2", "--capacity-blocks", "10", "--host-blocks", "3", "--no-migration", "--partial-reuse",
                 "--kv-bytes-per-token", "1024", "--concurrency", "2", "--engine", "vllm", "--vllm", "http://a:1",
                 "--vllm", "http://b:2")
    assert (got.capacity_blocks, got.host_blocks) == (20, 6), "the flags count per rank, the config the cluster"
    assert not got.migration and got.partial_reuse and got.costs.kv_bytes_per_token == 1024
    assert got.tiny.concurrency == 2 and got.vllm == ("http://a:1", "http://b:2")
    assert config("--ranks", "2", "--slowdown", "3", "--slowdown", "1.5").slowdown == (3.0, 1.5)
    assert config("--policy", "kv", "--kv-backlog-weight", "6").policy_options == {"kv": {"backlog_weight": 6.0}}
    assert config("--kv-speed-spread", "4", "--dynamo-overlap-score-weight", "2").policy_options == {
        "kv": {"speed_spread": 4.0}, "dynamo": {"overlap_score_weight": 2.0}}, "--policy all runs every policy"


def test_policy_options_reach_the_replayed_policy_over_what_the_replay_tells_it():
    told = SimConfig(ranks=2, migration=False)
    assert Simulator(Trace("t", 512, []), "kv", told).replicas[0].policy.config.allow_migration is False
    given = dataclasses.replace(told, policy_options={"kv": {"backlog_weight": 6, "allow_migration": True}})
    kv = Simulator(Trace("t", 512, []), "kv", given).replicas[0].policy.config
    assert (kv.backlog_weight, kv.allow_migration) == (6, True), "the options given win"
    assert kv.prefill_s_per_token == SimCosts().prefill_s_per_token, "the replay's costs still tell the rest"
    with pytest.raises(ValueError, match="policy 'round_robin' has no options"):
        SimConfig(policy_options={"round_robin": {"x": 1}})
    with pytest.raises(TypeError, match="backlog_wieght"):
        SimConfig(policy_options={"kv": {"backlog_wieght": 6}})
    with pytest.raises(ValueError, match=r"options of policies \['kv'\], which this replay does not run"):
        BenchConfig(policy="cache_aware", policy_options={"kv": {"backlog_weight": 6}})


def test_the_simulated_router_learns_each_ranks_speed_from_its_answers():
    """As a live router does (``router.engine_rates``): here each prefill is the costs' figure times the rank's
    slowdown, with nothing queued ahead, so the fit finds it; ``kv`` weighs it once ``speed_spread`` lets it."""
    spaced = Trace("spaced", 512, [TraceRequest(10.0 * i, 512, 0, (i,)) for i in range(24)])
    slowed = SimConfig(ranks=2, capacity_blocks=512, tokens_per_block=TPB, slowdown=(3.0,))
    sim = Simulator(spaced, "round_robin", slowed)
    sim.run()
    learned = sim.replicas[0].rates.prefill()
    p = SimCosts().prefill_s_per_token
    assert learned.keys() == {0, 1} and math.isclose(learned[0], 3 * p) and math.isclose(learned[1], p)
    alike = simulate(spaced, "kv", slowed).rank
    weighed = simulate(spaced, "kv", dataclasses.replace(slowed, policy_options={"kv": {"speed_spread": 4}})).rank
    assert (weighed[12:] == 1).sum() > (alike[12:] == 1).sum(), "the faster rank takes more once its speed is known"


def test_a_slowed_rank_takes_its_factor_of_every_prefill_and_the_queue_it_builds_moves_work_away():
    # one request at a time, far apart: each takes the costs' prefill on its rank, three times it on rank 0
    spaced = [TraceRequest(10.0 * i, 512, 0, (i,)) for i in range(8)]
    sim = SimConfig(ranks=2, capacity_blocks=64, tokens_per_block=TPB, slowdown=(3.0,))
    r = simulate(Trace("spaced", 512, spaced), "round_robin", sim)
    prefill = 512 * SimCosts().prefill_s_per_token
    assert np.allclose(r.ttft_s, [3 * prefill if rank == 0 else prefill for rank in r.rank])
    assert set(r.rank) == {0, 1}
    # prompts that share nothing, faster than the two ranks serve them: kv sees the slowed rank's queue grow and
    # gives it less of the work
    burst = Trace("burst", 512, [TraceRequest(0.02 * i, 512, 0, (100 + i,)) for i in range(60)])
    kv = simulate(burst, "kv", sim)
    assert (kv.rank == 0).sum() < (kv.rank == 1).sum()
    assert kv.makespan_s < simulate(burst, "round_robin", sim).makespan_s


def test_mooncake_replays_at_its_block_size():
    result = run(BenchConfig(trace=str(MOONCAKE), ranks=2, policy="kv", limit=150, capacity_blocks=2000, jobs=1))
    assert result.sim.tokens_per_block == 512
    s = result.summaries["kv"]
    assert s.requests == 150 and 0 < s.hit_rate <= result.bounds.infinite_hit_rate


def test_default_capacity_fits_every_request():
    result = run(BenchConfig(trace="synthetic", limit=60, policy="kv", jobs=1))
    largest = max(-(-(r.input_length + r.output_length) // 64) for r in result.trace.requests)
    assert result.sim.tokens_per_block == 64
    assert result.sim.capacity_blocks >= max(result.unique_blocks // 4, 2 * largest * 4)
    assert result.summaries["kv"].requests == 60
