"""``kvledger up``'s flags, built from the config dataclasses; no Ray, no processes but two torch-free checks."""
from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import stat
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
from processes import run

from kvledger.coordinator.config import ClusterConfig, default_cache
from kvledger.coordinator.router_actor import RouterActorConfig
from kvledger.launch import owner
from kvledger.launch import up as up_module
from kvledger.launch.cli import main
from kvledger.launch.flags import SIZE, Converter, add_dataclass_flags, attribute_docs, format_size, parse_size
from kvledger.launch.policy_flags import add_policy_flags
from kvledger.launch.state import options_path
from kvledger.launch.up import UpOptions, load_options, save_options
from kvledger.router.config import RouterConfig

MiB = 1 << 20


@dataclass(frozen=True)
class Knobs:
    """A dataclass with one field of every kind the flags support."""

    count: int = 3
    """How many."""
    ratio: float | None = 0.5
    """A share (100% is 1)."""
    name: str = "x"
    mode: Literal["fast", "slow"] = "fast"
    """Which way."""
    verbose: bool = False
    """Say more."""
    tags: tuple[str, ...] = ()
    """Labels."""
    budget: int | None = None
    """Bytes."""
    internal: int = 0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"Knobs.count must be >= 1, got {self.count}")


def knobs_parser(**kwargs) -> tuple[argparse.ArgumentParser, object]:
    p = argparse.ArgumentParser(prog="knobs")
    return p, add_dataclass_flags(p, Knobs(), title="knobs", converters={"budget": SIZE}, exclude=("internal",),
                                  **kwargs)


@pytest.fixture
def ran(monkeypatch, tmp_path):
    """``main(["up", ...])`` with ``up``/``up_detached`` recorded instead of run: what each was handed."""
    monkeypatch.setenv("KVLEDGER_HOME", str(tmp_path))
    calls: list[tuple[str, UpOptions]] = []
    monkeypatch.setattr(up_module, "up", lambda options: calls.append(("up", options)) or 0)
    monkeypatch.setattr(up_module, "up_detached", lambda options: calls.append(("detached", options)) or 0)

    def run(*argv: str) -> tuple[str, UpOptions]:
        assert main(["up", *argv]) == 0
        return calls.pop()
    return run


def refused(capsys, *argv: str) -> str:
    """``kvledger up ARGV`` must exit 2; its error message."""
    with pytest.raises(SystemExit) as e:
        main(["up", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


def up_help(capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        main(["up", "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------------- the library, on a small dataclass


def test_attribute_docs_are_the_string_after_each_field():
    docs = attribute_docs(Knobs)
    assert docs["count"] == "How many." and docs["tags"] == "Labels."
    assert "name" not in docs and "internal" not in docs


def test_flags_have_names_types_help_and_defaults_from_the_dataclass():
    p, flags = knobs_parser(prefix="k", rename={"count": "n"})
    assert dict(flags.flags) == {"count": "--n", "ratio": "--k-ratio", "name": "--k-name", "mode": "--k-mode",
                                 "verbose": "--k-verbose", "tags": "--k-tags", "budget": "--k-budget"}
    text = " ".join(p.format_help().split())
    assert "knobs: --n INT How many. (default: 3)" in text
    assert "--k-ratio FLOAT A share (100% is 1). (default: 0.5)" in text
    assert "--k-mode {fast,slow} Which way. (default: fast)" in text
    assert "--k-verbose, --no-k-verbose Say more. (default: false)" in text
    assert "--k-tags STR Labels. Repeatable. (default: none)" in text
    assert "--k-budget SIZE Bytes. (default: none)" in text and "--internal" not in text


def test_only_the_given_flags_change_the_default_instance():
    p, flags = knobs_parser()
    assert flags.build(p.parse_args([]), p) == Knobs()
    args = p.parse_args(["--count", "7", "--ratio", "0.25", "--mode", "slow", "--verbose", "--tags", "a",
                         "--tags", "b", "--budget", "2MiB", "--name", "y"])
    assert flags.given(args) == {"count": 7, "ratio": 0.25, "mode": "slow", "verbose": True, "tags": ("a", "b"),
                                 "budget": 2 * MiB, "name": "y"}
    assert flags.build(args, p, internal=5) == Knobs(7, 0.25, "y", "slow", True, ("a", "b"), 2 * MiB, 5)
    assert flags.build(p.parse_args(["--no-verbose"]), p) == Knobs(verbose=False)


def test_a_value_the_dataclass_refuses_exits_2_naming_its_flag(capsys):
    p, flags = knobs_parser()
    with pytest.raises(SystemExit) as e:
        flags.build(p.parse_args(["--count", "0"]), p)
    assert e.value.code == 2
    assert "knobs: error: argument --count: Knobs.count must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "medium"])
    assert "invalid choice: 'medium'" in capsys.readouterr().err


def test_policy_flags_can_be_limited_to_the_policies_a_command_runs(capsys):
    p = argparse.ArgumentParser(prog="bench")
    flags = add_policy_flags(p, ["kv"])   # benchmarks/bench_routers.py: its router runs kv only
    args = p.parse_args(["--kv-speed-spread", "4", "--no-kv-allow-migration"])
    assert flags.options(args, ["kv"]) == {"kv": {"speed_spread": 4.0, "allow_migration": False}}
    assert flags.options(p.parse_args([]), ["kv"]) == {}
    with pytest.raises(SystemExit):
        p.parse_args(["--cache-aware-cache-threshold", "0.5"])
    assert "unrecognized arguments: --cache-aware-cache-threshold" in capsys.readouterr().err


def test_a_field_type_without_a_flag_asks_for_a_converter():
    @dataclass
    class Dtyped:
        dtype: torch.dtype = torch.float16

    with pytest.raises(TypeError, match="converters"):
        add_dataclass_flags(argparse.ArgumentParser(), Dtyped(), title="t")
    p = argparse.ArgumentParser()
    flags = add_dataclass_flags(p, Dtyped(), title="t",
                                converters={"dtype": Converter.choice({"float16": torch.float16,
                                                                       "bfloat16": torch.bfloat16})})
    assert flags.build(p.parse_args(["--dtype", "bfloat16"]), p) == Dtyped(torch.bfloat16)
    assert "(default: float16)" in p.format_help()


@pytest.mark.parametrize("text,size", [("64MiB", 64 * MiB), ("1GiB", 1 << 30), ("512KiB", 512 << 10),
                                       ("4096", 4096), ("1.5KiB", 1536), ("2 MB", 2_000_000), ("0", 0)])
def test_sizes_take_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["12XB", "-1", "1.3B", "", "MiB", "1,5MiB"])
def test_a_bad_size_is_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_sizes_are_shown_in_the_largest_exact_unit():
    assert [format_size(s) for s in (64 * MiB, 1 << 30, 3 << 10, 1536, 1000, 0)] == \
        ["64MiB", "1GiB", "3KiB", "1536", "1000", "0"]


# ---------------------------------------------------------------------- kvledger up


def test_up_help_shows_every_config_with_its_docstring_and_default(capsys, monkeypatch):
    text = up_help(capsys, monkeypatch)
    for title in ("cluster:", "cache (each rank):", "router:", "kv policy (with --policy kv):",
                  "llm_d policy (with --policy llm_d):", "router HTTP API:"):
        assert title in text
    assert ("--ranks INT Rank actors (one per GPU on a GPU cluster); 0: none, the router fronts vLLM servers only "
            "(`--vllm`). (default: 2)") in text
    assert "--vllm STR vLLM OpenAI servers to route to as well" in text
    assert "--cpus-per-rank FLOAT" in text and "--device {auto,cpu,cuda}" in text
    assert "--tokens-per-block INT Tokens whose K/V one block holds. (default: 16)" in text
    assert "--dtype {float16,bfloat16,float32} Element type of the pools. (default: float32)" in text
    assert "--primary-bytes SIZE Byte budget of the device tier; the block count is what fits. (default: 64MiB)" \
        in text
    assert "--secondary-bytes SIZE" in text and "(default: 16MiB)" in text
    assert "--policy {kv,round_robin,random,power_of_two,cache_aware,dynamo,llm_d}" in text
    assert "--kv-allow-migration, --no-kv-allow-migration" in text
    for flag in ("--kv-prefill-s-per-token", "--llm-d-prefix-weight", "--cache-aware-cache-threshold",
                 "--dynamo-overlap-score-weight", "--vllm-events TCP[,REPLAY]", "--host STR", "--port INT",
                 "--address", "--detach", "--workload {bundled}", "--no-router", "--router-seed INT",
                 "--primary-bytes-per-rank SIZE[,SIZE...]", "--routers INT"):
        assert flag in text
    for excluded in ("--cache ", "--detached", "--materialize", "--policy-options", "--router-tokens"):
        assert excluded not in text


def test_up_without_flags_runs_the_dataclass_defaults(ran):
    how, options = ran()
    assert how == "up"
    assert options == UpOptions(cluster=dataclasses.replace(ClusterConfig(), detached=True),
                                router=RouterActorConfig(), address=None, workload=None)
    assert options.cluster.cache == default_cache()


def test_only_the_given_flags_change_the_configs(ran):
    _, options = ran("--ranks", "3", "--device", "cpu", "--cpus-per-rank", "0.25", "--tokens-per-block", "32",
                     "--dtype", "bfloat16", "--secondary-bytes", "1GiB", "--no-enable-partial-reuse",
                     "--host", "0.0.0.0", "--allow-unauthenticated", "--port", "0", "--policy", "dynamo", "--dynamo-overlap-score-weight",
                     "2", "--vllm-events", "tcp://h:1", "--vllm-events", "tcp://h:2,tcp://h:3", "--router-seed",
                     "5", "--seed", "7")
    cache = dataclasses.replace(default_cache(), tokens_per_block=32, dtype=torch.bfloat16, secondary_bytes=1 << 30,
                                enable_partial_reuse=False)
    assert options.cluster == dataclasses.replace(ClusterConfig(), num_ranks=3, device="cpu", num_cpus_per_rank=0.25,
                                                  cache=cache, seed=7, detached=True)
    assert options.router == RouterActorConfig(
        host="0.0.0.0", port=0, vllm_events=("tcp://h:1", "tcp://h:2,tcp://h:3"), allow_unauthenticated=True,
        router=RouterConfig(policy="dynamo", seed=5, policy_options={"overlap_score_weight": 2.0}))


def test_a_block_count_replaces_the_default_byte_budget(ran):
    _, options = ran("--num-primary-blocks", "100")
    cache = options.cluster.cache
    assert (cache.primary_bytes, cache.num_primary_blocks, cache.primary_blocks()) == (None, 100, 100)
    assert cache.secondary_bytes == default_cache().secondary_bytes
    assert options.cluster.gpu_memory_fraction is None, "on CUDA the given budget wins over the memory share"
    _, options = ran("--num-secondary-blocks", "7", "--primary-bytes", "1MiB", "--gpu-memory-fraction", "0.25")
    cache = options.cluster.cache
    assert (cache.secondary_bytes, cache.secondary_blocks(), cache.primary_bytes) == (None, 7, MiB)
    assert options.cluster.gpu_memory_fraction == 0.25
    _, options = ran("--num-primary-blocks", "100", "--primary-bytes", "2MiB")
    assert (options.cluster.cache.primary_bytes, options.cluster.cache.num_primary_blocks) == (2 * MiB, 100)


def test_per_rank_budgets_and_policy_options(ran):
    _, options = ran("--ranks", "2", "--primary-bytes-per-rank", "1MiB,512KiB", "--no-kv-allow-migration",
                     "--kv-prefill-s-per-token", "1e-4")
    assert options.cluster.primary_bytes_per_rank == [MiB, 512 << 10]
    assert options.router.router.policy == "kv"
    assert options.router.router.policy_options == {"allow_migration": False, "prefill_s_per_token": 1e-4}


def test_no_router_and_address_and_workload(ran):
    _, options = ran("--no-router", "--address", "10.0.0.1:6379")
    assert options.router is None and options.address == "10.0.0.1:6379" and options.cluster.detached
    _, options = ran("--workload", "bundled")
    assert options.workload == "bundled" and not options.cluster.detached


def test_prefill_and_decode_ranks_make_the_cluster_and_the_split_flags_reach_the_router(ran):
    _, options = ran("--prefill-ranks", "2", "--decode-ranks", "3", "--split-mode", "always",
                     "--min-split-tokens", "64")
    assert (options.cluster.num_ranks, options.cluster.prefill_ranks, options.cluster.decode_ranks) == (5, 2, 3)
    assert options.router.router == RouterConfig(split_mode="always", min_split_tokens=64)
    _, options = ran("--ranks", "3", "--prefill-ranks", "1")
    assert (options.cluster.num_ranks, options.cluster.prefill_ranks) == (3, 1)


def test_router_replicas_are_one_flag(ran):
    _, options = ran("--routers", "3", "--port", "9000")
    assert options.router == RouterActorConfig(port=9000, routers=3)


@pytest.mark.parametrize("abbrev", ["--detach", "--det"])
def test_detach_and_its_abbreviation_hand_the_options_to_the_detached_owner(ran, abbrev):
    how, options = ran(abbrev, "--ranks", "1", "--port", "0")
    assert how == "detached" and options.cluster.num_ranks == 1 and options.router.port == 0


@pytest.mark.parametrize("argv,message", [
    (["--tokens-per-block", "0"], "argument --tokens-per-block: CacheConfig.tokens_per_block must be a positive int"),
    (["--policy", "fastest"], "argument --policy: invalid choice 'fastest'"),
    (["--policy", "dynamo", "--dynamo-overlap-score-weight", "-1"],
     "argument --dynamo-overlap-score-weight: overlap_score_weight must be a finite number >= 0"),
    (["--dynamo-overlap-score-weight", "-1"],
     "--dynamo-overlap-score-weight: option(s) of policy 'dynamo', but the policy is 'kv'"),
    (["--kv-prefill-s-per-token", "1", "--policy", "llm_d"],
     "--kv-prefill-s-per-token: option(s) of policy 'kv', but the policy is 'llm_d'"),
    (["--ranks", "-1"], "argument --ranks: ClusterConfig.num_ranks must be an int >= 0"),
    (["--ranks", "0"], "--ranks 0 starts no rank of its own: give the router vLLM servers (--vllm URL)"),
    (["--port", "70000"], "argument --port: port must be in 0..65535"),
    (["--routers", "0"], "argument --routers: routers must be an int >= 1, got 0"),
    (["--routers", "4", "--port", "65534"],
     "argument --port/--routers: 4 routers from port 65534 would need ports past 65535"),
    (["--no-router", "--routers", "2"], "--no-router starts no router; drop --routers"),
    (["--primary-bytes", "lots"], "argument --primary-bytes: expected a size such as 64MiB"),
    (["--dtype", "int8"], "argument --dtype: invalid choice 'int8'"),
    (["--vllm-events", "http://h:1"], "argument --vllm-events: a vLLM events endpoint is tcp://"),
    (["--primary-bytes-per-rank", "1MiB"], "argument --primary-bytes-per-rank: primary_bytes_per_rank has 1 entries"),
    (["--num-primary-blocks", "0"], "the primary tier needs at least one block"),
    (["--det", "--workload", "bundled"], "--workload runs and stops; it cannot be combined with --detach"),
    (["--no-router", "--port", "9"], "--no-router starts no router; drop --port"),
    (["--no-router", "--workload", "bundled"], "workload is sent through the router; drop --no-router"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--prefill-ranks", "2"], "prefill_ranks must be an int in 0..num_ranks-1 (a decode rank at least)"),
    (["--ranks", "4", "--prefill-ranks", "1", "--decode-ranks", "2"],
     "1 prefill ranks and 2 decode ranks make 3, not num_ranks=4"),
    (["--split-mode", "sometimes"], "argument --split-mode: invalid choice"),
])
def test_bad_input_exits_2_naming_the_flag(capsys, argv, message):
    err = refused(capsys, *argv)
    assert "kvledger up: error: " in err and message in err, err


# ---------------------------------------------------------------------- the detach handoff


def test_the_options_reach_the_detached_owner_unchanged(ran, monkeypatch):
    _, options = ran("--ranks", "1", "--dtype", "float16", "--policy", "llm_d", "--llm-d-prefix-weight", "5")
    path = save_options(options)
    assert path == options_path() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    received = []
    monkeypatch.setattr(owner, "up", lambda opts: received.append(opts) or 0)
    assert owner.main([str(path)]) == 0
    assert received == [options] and not path.exists(), "the owner consumes the handoff file"


def test_a_handoff_file_of_another_kind_is_refused(tmp_path):
    path = tmp_path / "other.pickle"
    path.write_bytes(pickle.dumps({"not": "options"}))
    with pytest.raises(TypeError, match="not the UpOptions"):
        load_options(path)


# ---------------------------------------------------------------------- the other sub-commands stay light


def python(code: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code], timeout=120)   # own session: a timeout kills all it started


def test_route_help_does_not_import_torch():
    proc = python("import sys\n"
                  "from kvledger.launch.cli import main\n"
                  "for command in ('route', 'monitor', 'status', 'down'):\n"
                  "    try:\n"
                  "        main([command, '--help'])\n"
                  "    except SystemExit as e:\n"
                  "        assert e.code == 0, e.code\n"
                  "assert main(['route', 'hi', '--url', 'http://127.0.0.1:1']) == 1\n"
                  "try:\n"
                  "    main(['--help'])\n"
                  "except SystemExit as e:\n"
                  "    assert e.code == 0, e.code\n"
                  "assert 'torch' not in sys.modules, 'route, monitor, status, down or the top-level help imported torch'\n")
    assert proc.returncode == 0, proc.stderr
    assert "usage: kvledger route" in proc.stdout and "send one prompt through the router" in proc.stdout
    assert "usage: kvledger monitor" in proc.stdout and "usage: kvledger down" in proc.stdout


def test_top_level_help_lists_every_sub_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "up", "route", "monitor", "bench", "status", "down"):
        assert f"    {command} " in out
