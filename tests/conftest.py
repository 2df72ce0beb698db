"""Test-session setup: the tests directory is importable for its small helper modules; one Ray per session."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kvledger.coordinator  # noqa: E402,F401  (sets the Ray environment before anything imports ray)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (127.0.0.1, no dashboard) for the whole test session, shut down at its end."""
    import ray

    from kvledger.coordinator.ray_env import init_ray

    if not ray.is_initialized():
        init_ray(num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()
