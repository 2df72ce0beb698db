"""Starting or joining Ray the same way everywhere: loopback sockets, one auth mode, code shipped to nodes.

Every process of one cluster must see the same ``RAY_AUTH_MODE``; it is set
here before ``ray.init`` and passed to every worker through the job's runtime
environment, together with the packages the rank actors import (so a
multi-node cluster needs no shared file system).
"""
from __future__ import annotations

import logging
import os

import coordinator
import worker

LOOPBACK = "127.0.0.1"
ENV_DEFAULTS = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ray_env_vars() -> dict[str, str]:
    """Set (where unset) and return the environment every process of the cluster shares."""
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in ENV_DEFAULTS}


def runtime_env(ship_code: bool) -> dict:
    """The job's runtime environment: shared env vars, and our packages where nodes may not have them.

    ``worker`` and ``coordinator`` are what rank actors import; ``router`` rides
    along for the router actor.
    """
    env: dict = {"env_vars": ray_env_vars()}
    if ship_code:
        import router
        env["py_modules"] = [worker, coordinator, router]
    return env


def init_ray(address: str | None = None, num_cpus: float | None = None, namespace: str = "kvledger",
             ship_code: bool | None = None, log_to_driver: bool = True) -> None:
    """Start a local Ray on 127.0.0.1 (``address=None``) or join ``address``; no dashboard.

    ``ship_code`` (default: when joining) sends ``worker`` and ``coordinator`` to
    the nodes through ``py_modules``.
    """
    import ray

    env = runtime_env(address is not None if ship_code is None else ship_code)
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
