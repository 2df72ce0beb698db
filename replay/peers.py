"""The routers people pick instead of kvledger's, started from their PyPI packages in front of the same servers.

``kvledger bench --engine vllm --peer sglang-router --peer vllm-router`` runs,
after kvledger's own policies and through the same vLLM servers with their
prefix caches reset before each: sglang-router's ``cache_aware``, and
vllm-router's ``kv_aware`` (fed the servers' own ZMQ KV events), ``cache_aware``
and ``round_robin``; ``NAME:POLICY`` picks one. They are bench extras, never
kvledger's dependencies: ``peer_venv`` installs ``PEER_PINS`` into a virtual
environment of their own under the cache root (``$KVLEDGER_CACHE`` or
``~/.cache/kvledger``) on first use. Each runs as a process of its own on
127.0.0.1, stopped by its own process id.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import tempfile
import time
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvledger.router.vllm_server import VllmServer, VllmServerInfo

PEER_PINS = ("sglang-router==0.3.2", "vllm-router==0.1.17")
#: Each peer's policies that ``--peer NAME`` runs, in order; kvledger's ``kv`` is measured against them.
PEER_POLICIES = {"sglang-router": ("cache_aware",), "vllm-router": ("kv_aware", "cache_aware", "round_robin")}
INSTALL_TIMEOUT_S = 1800.0
START_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Peer:
    """One peer router and the policy it runs."""

    router: str
    policy: str

    @property
    def name(self) -> str:
        return f"{self.router} {self.policy}"


def parse_peers(specs: tuple[str, ...]) -> list[Peer]:
    """``--peer`` values (``NAME`` or ``NAME:POLICY``) as the runs they stand for; a ``ValueError`` names a bad one."""
    out: list[Peer] = []
    for spec in specs:
        router, _, policy = spec.partition(":")
        known = PEER_POLICIES.get(router)
        if known is None:
            raise ValueError(f"--peer {spec!r}: unknown router {router!r}; choose one of {sorted(PEER_POLICIES)}")
        if policy and policy not in known:
            raise ValueError(f"--peer {spec!r}: {router} policy {policy!r} is not one of {known}")
        out += [Peer(router, p) for p in ((policy,) if policy else known) if Peer(router, p) not in out]
    return out


def cache_root() -> Path:
    """Where the bench's extras live between runs (the peer routers here; the suite's vLLM beside them)."""
    return Path(os.environ.get("KVLEDGER_CACHE") or Path.home() / ".cache" / "kvledger")


def peer_venv() -> Path:
    """The ``bin`` of the peer routers' virtual environment, built from ``PEER_PINS`` if it is missing."""
    root = cache_root() / ("peer-routers-" + "-".join(p.split("==")[1] for p in PEER_PINS))
    done = root / ".kvledger-pip-install-done"
    if done.exists():
        return root / "bin"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one build at a time (the suite and a bench); the install is bounded
        if not done.exists():   # a half-built one (killed mid-install) is built again from scratch
            venv.create(root, with_pip=True, clear=True)
            subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", *PEER_PINS], check=True,
                           timeout=INSTALL_TIMEOUT_S)
            done.touch()
    return root / "bin"


class RouterProcess:
    """A router serving on 127.0.0.1 in a process of its own session, ready once a one-token completion of ``model``
    goes through; ``port``: where it serves (``None``: it prints its port as the first line of its stdout)."""

    stdin_grace_s = 0.0
    """How long ``close`` waits for it to exit on its stdin closing before it is terminated."""

    def __init__(self, name: str, cmd: list[str], model: str, port: int | None) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvledger-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE if port is None else self.log,
                                     stderr=self.log, text=True, start_new_session=True)
        try:
            if port is None:
                line = self.proc.stdout.readline() if self.proc.stdout else ""
                if not line.strip().isdigit():
                    raise RuntimeError(f"{name} did not start: {self.tail()}")
                port = int(line)
            self.url = f"http://127.0.0.1:{port}"
            wait_serving(self.url, self.proc, name, model, self.tail)
        except BaseException:
            self.close()
            raise

    def cpu_s(self) -> float:
        """User and system seconds of the router's live processes (its session: a launcher and what it started),
        from ``/proc``: what it takes from the engines it shares a machine with."""
        ticks = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:   # it exited
                continue
            if int(fields[3]) == self.proc.pid:   # after the name: state, ppid, pgrp, session, ...
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def close(self) -> None:
        """Stop it (its whole process group), then drop its log."""
        if self.proc.stdin:
            self.proc.stdin.close()
        for sig, wait_s in ((None, self.stdin_grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
            if sig is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class PeerRouter(RouterProcess):
    """``peer`` in front of ``servers`` (``events``: each server's ZMQ KV-event endpoint, for ``kv_aware``)."""

    def __init__(self, peer: Peer, servers: list[str], events: list[str], model: str, block_size: int) -> None:
        from kvledger.coordinator.router_actor import free_port   # Ray's import, only when a peer is run

        self.peer = peer
        bin_ = peer_venv()
        port = free_port("127.0.0.1")
        cmd = [str(bin_ / "sglang-router"), "launch"] if peer.router == "sglang-router" else [str(bin_ / "vllm-router")]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", peer.policy, "--worker-urls", *servers,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port("127.0.0.1"))]
        if peer.policy == "kv_aware":
            cmd += [a for url, ep in zip(servers, events) for a in ("--kv-event-source", f"{url}={ep}")]
            cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        super().__init__(peer.name, cmd, model, port)


def wait_serving(url: str, proc: subprocess.Popen, name: str, model: str, tail: Callable[[], str]) -> None:
    """Until a one-token completion of ``model`` goes through the router at ``url`` (every worker found healthy);
    an error with ``tail()`` (its log) if ``proc`` exits first or ``START_TIMEOUT_S`` passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(timeout=10.0) as c:
        while time.monotonic() < deadline:   # bounded by the deadline
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}): {tail()}")
            try:
                r = c.post(f"{url}/v1/completions", json={"model": model, "prompt": "warm", "max_tokens": 1})
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{name} not serving after {START_TIMEOUT_S:g} s: {tail()}")


def event_endpoints(urls: list[str]) -> list[str]:
    """Each server's ZMQ KV-event endpoint as a subscriber on this machine reaches it, as the router finds it
    (``VllmServer.discover``; ``""`` for a server that publishes none)."""
    out = []
    for url in urls:
        server = VllmServer(url)
        try:
            out.append(event_endpoint(server.discover()))
        finally:
            server.close()
    return out


def event_endpoint(info: VllmServerInfo) -> str:
    """Data-parallel rank 0's KV-event endpoint of a discovered server (``""``: it publishes none)."""
    source = info.events.get(0)
    return "" if source is None else source.endpoint


__all__ = ["PEER_PINS", "PEER_POLICIES", "Peer", "PeerRouter", "RouterProcess", "cache_root", "event_endpoints",
           "event_endpoint", "parse_peers", "peer_venv", "wait_serving"]
