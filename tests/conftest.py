"""Test-session setup: the tests directory is importable for its small helper modules; every test carries the
marker of its tier; one Ray per session; hypothesis derandomized unless asked otherwise.

Tiers, one folder and one marker each (``pytest -m unit`` runs one): ``unit/`` (no Ray, no subprocess: the quick
loop), ``contract/`` (one suite over every rank client: in-process and Ray), ``integration/`` (real Ray
clusters, spawned processes, the command line) and ``vllm/`` (real vLLM servers, in a virtual environment the suite
builds when it is missing). A test file outside a tier folder is an error, so none runs unmarked.

Hypothesis profiles (``HYPOTHESIS_PROFILE``): ``ci``, the default, derandomizes every property test (the
examples come from a hash of the test: the same on every run until the test or Hypothesis changes) and uses no example
database, so a run fails only for a reason it fails for again; ``explore`` draws fresh random examples each run
(locally, to look for new failures; a failure it finds is reported with the ``@reproduce_failure`` blob to pin
it). Each test keeps its own ``max_examples`` (its ``settings`` decorator); the profile sets only the rest.
``test_ledger_stateful.py`` stays derandomized under ``explore`` too: its coverage floors hold for its fixed
sequence of workloads, not for every random one.
"""
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TIERS = ("unit", "contract", "integration", "vllm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        tier = item.path.relative_to(here).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test file belongs in one of the tier folders {TIERS}")
        item.add_marker(getattr(pytest.mark, tier))


from kvledger.coordinator.ray_env import configure  # noqa: E402

configure()   # the Ray environment, before any test module imports ray


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (127.0.0.1, no dashboard, Ray's token auth on as in every kvledger cluster) for the whole
    test session, shut down at its end."""
    import ray

    from kvledger.coordinator.ray_env import init_ray

    if not ray.is_initialized():
        init_ray(num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def vllm_servers(request, tmp_path_factory):
    """Two real vLLM servers for the session (block size 32 with a publisher that binds, 64 with one that
    connects), tool calling on, stopped by their process ids when it ends (``tests/vllm_engines.py``). The
    modules share them (a start costs a minute of both cores): each module's prompts start with tokens of its
    own, so none finds another's cached blocks."""
    from vllm_engines import TOOL_CALLING, EngineSpec, start_engines

    return start_engines(request, tmp_path_factory, [EngineSpec(block_size=32, args=TOOL_CALLING),
                                                     EngineSpec(block_size=64, publisher_connects=True,
                                                                args=TOOL_CALLING)])


@pytest.fixture(scope="session")
def vllm_server(vllm_servers):
    """One real vLLM server (block size 32): the first of ``vllm_servers``."""
    return vllm_servers[0]
