"""Starting or joining Ray the same way everywhere: loopback sockets, token auth on, code shipped to nodes.

Every process of one cluster must see the same ``RAY_AUTH_MODE``; it is set
here before ``ray.init`` (``token``: Ray's own authentication, so nothing
without the cluster's token can join it, submit work or read its objects) and
passed to every worker through the job's runtime environment, together with
the kvledger package itself (so a multi-node cluster needs no shared file
system and no install on the other nodes). The token itself never travels in
the runtime environment (anyone who can read the job's metadata would have it):
every process reads it where Ray looks for it (``RAY_AUTH_TOKEN``, the file
``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token``); ``ensure_auth_token``
creates that file once on the machine that starts a cluster.

``configure`` sets that environment, and nothing else does: Ray reads
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when it is first imported, so each
entry point that starts or joins a cluster (the command line, the detached
owner, the benchmarks, the test session) calls it before anything imports ray,
and ``init_ray`` calls it again (a no-op then). This module imports nothing of
Ray at the top.
"""
from __future__ import annotations

import importlib
import logging
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: Read by Ray when it is first imported; off, a local Ray takes the loopback address for its node.
READ_AT_IMPORT = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
ENV_DEFAULTS = {"RAY_AUTH_MODE": "token", READ_AT_IMPORT: "0"}
#: Where Ray reads the token when neither ``RAY_AUTH_TOKEN`` nor ``RAY_AUTH_TOKEN_PATH`` is set.
DEFAULT_TOKEN_PATH = Path("~/.ray/auth_token")


def configure() -> dict[str, str]:
    """Set (where unset) and return the environment every process of the cluster shares; call it before
    ``import ray`` (see the module docstring). Warns when ray was imported first, without it."""
    if READ_AT_IMPORT not in os.environ and "ray" in sys.modules:
        logger.warning("ray was imported before kvledger's ray_env.configure() set %s=0: a local cluster started "
                       "here may listen on the machine's address, not only on %s", READ_AT_IMPORT, LOOPBACK)
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in ENV_DEFAULTS}


def auth_token_path() -> Path | None:
    """The file Ray reads the token from, or ``None`` when ``RAY_AUTH_TOKEN`` holds it."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or DEFAULT_TOKEN_PATH).expanduser()


def ensure_auth_token() -> Path | None:
    """Make sure this machine has the cluster's token (token mode only); returns the file holding it.

    A missing file is created once, readable by this user only, and never
    rewritten: a driver or test session starting at the same moment reads the
    one the first created (Ray's own generator rewrites the file, so two
    starts racing could leave the first cluster with a token nobody holds).
    """
    if os.environ.get("RAY_AUTH_MODE", ENV_DEFAULTS["RAY_AUTH_MODE"]) != "token":
        return None
    path = auth_token_path()
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if not path.read_text().strip():
            raise ValueError(f"the Ray auth token file {path} is empty: remove it (a new token is made) or copy "
                             "the cluster's token into it") from None
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


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
    env: dict = {"env_vars": configure()}
    if shipped is not None:
        env["py_modules"] = [str(shipped)]
    return env


def init_ray(address: str | None = None, num_cpus: float | None = None, namespace: str = "kvledger",
             ship_code: bool | None = None, log_to_driver: bool = True) -> None:
    """Start a local Ray on 127.0.0.1 (``address=None``) or join ``address``; no dashboard; token auth on.

    Starting one creates this machine's token if there is none (``ensure_auth_token``); joining needs the
    token of the cluster at ``address`` (Ray refuses the driver otherwise). ``ship_code`` (default: when
    joining) sends the kvledger package to the nodes through ``py_modules`` (see ``package_for_nodes``).
    """
    if address is not None if ship_code is None else ship_code:
        with package_for_nodes() as shipped:   # uploaded by ray.init, so it may go once that returns
            _init(address, num_cpus, namespace, runtime_env(shipped), log_to_driver)
    else:
        _init(address, num_cpus, namespace, runtime_env(None), log_to_driver)


def _init(address: str | None, num_cpus: float | None, namespace: str, env: dict, log_to_driver: bool) -> None:
    import ray
    if address is None:
        ensure_auth_token()
        ray.init(address="local", include_dashboard=False, _node_ip_address=LOOPBACK,
                 num_cpus=None if num_cpus is None else int(num_cpus), namespace=namespace, runtime_env=env,
                 logging_level=logging.WARNING, log_to_driver=log_to_driver)
    else:
        ray.init(address=address, namespace=namespace, runtime_env=env, logging_level=logging.WARNING,
                 log_to_driver=log_to_driver)
