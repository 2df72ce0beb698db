"""Starting or joining Ray the same way everywhere: loopback sockets, one auth mode, code shipped to nodes.

Every process of one cluster must see the same ``RAY_AUTH_MODE``; it is set
here before ``ray.init`` and passed to every worker through the job's runtime
environment, together with the kvledger package itself (so a multi-node
cluster needs no shared file system and no install on the other nodes).

This module imports nothing of Ray at the top: the package's ``__init__``
calls ``ray_env_vars`` before anything imports ray.
"""
from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOOPBACK = "127.0.0.1"
ENV_DEFAULTS = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ray_env_vars() -> dict[str, str]:
    """Set (where unset) and return the environment every process of the cluster shares."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in ENV_DEFAULTS}


#: The subpackages a node needs: rank actors import ``worker`` and ``coordinator``, the router actor ``router``.
SHIPPED = ("worker", "coordinator", "router")


@contextmanager
def package_for_nodes() -> Iterator[Path]:
    """A folder named ``kvledger`` holding this installation's subpackages, while the context lasts.

    Ray's ``py_modules`` uploads a folder under its own name and puts it on the
    workers' path, so the nodes import ``kvledger.worker`` from it whether this
    is an editable checkout (where the subpackages live in the design card's
    top-level folders) or an installed wheel. A wheel itself would not do: Ray
    installs a ``py_modules`` wheel with its dependencies, torch among them.
    """
    with tempfile.TemporaryDirectory(prefix="kvledger-ship-") as tmp:
        root = Path(tmp) / "kvledger"
        for name in SHIPPED:
            src = Path(importlib.import_module(f"kvledger.{name}").__file__).parent
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        yield root


def runtime_env(shipped: Path | None) -> dict:
    """The job's runtime environment: the shared env vars, and the package folder when it is shipped."""
    env: dict = {"env_vars": ray_env_vars()}
    if shipped is not None:
        env["py_modules"] = [str(shipped)]
    return env


def init_ray(address: str | None = None, num_cpus: float | None = None, namespace: str = "kvledger",
             ship_code: bool | None = None, log_to_driver: bool = True) -> None:
    """Start a local Ray on 127.0.0.1 (``address=None``) or join ``address``; no dashboard.

    ``ship_code`` (default: when joining) sends the kvledger package to the
    nodes through ``py_modules`` (see ``package_for_nodes``).
    """
    if address is not None if ship_code is None else ship_code:
        with package_for_nodes() as shipped:   # uploaded by ray.init, so it may go once that returns
            _init(address, num_cpus, namespace, runtime_env(shipped), log_to_driver)
    else:
        _init(address, num_cpus, namespace, runtime_env(None), log_to_driver)


def _init(address: str | None, num_cpus: float | None, namespace: str, env: dict, log_to_driver: bool) -> None:
    import ray
    from ray._private import ray_constants
    if address is None and ray_constants.ENABLE_RAY_CLUSTER:
        logging.getLogger(__name__).warning(
            "ray was imported before kvledger's coordinator package set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: "
            "the local cluster will listen on the machine's address, not only on 127.0.0.1")
    if address is None:
        ray.init(address="local", include_dashboard=False, _node_ip_address=LOOPBACK,
                 num_cpus=None if num_cpus is None else int(num_cpus), namespace=namespace, runtime_env=env,
                 logging_level=logging.WARNING, log_to_driver=log_to_driver)
    else:
        ray.init(address=address, namespace=namespace, runtime_env=env, logging_level=logging.WARNING,
                 log_to_driver=log_to_driver)
