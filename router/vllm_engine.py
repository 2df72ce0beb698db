"""A real vLLM server as an ``Engine``: generations through its OpenAI API, its load from its metrics.

The server does its own sampling, stop strings and ``n`` choices, so a
generation goes to it as the client's fields plus the prompt as the token ids
the router hashed (a chat keeps its messages: the server renders them as the
router did), asking for the output's token ids too. A Responses request goes
as the client sent it, the model and the salt apart (the server renders it).
Its answer comes back as it is. A server that does not answer is lost
(``RankDiedError``); one that answers with an error refused the request
(``EngineRefusedError``), with its status and body. Its events reach the index
over ZMQ (``router.vllm_events``), from where ``info().events`` says.

A server run with ``--data-parallel-size N`` is N engines (``connect_all``), one
per engine core: each sends its requests to its own data-parallel rank, reads
its own load from the metrics, and publishes its own events. Each reads its
measured host-tier onboard time from its metrics too (``router.vllm_onboard``).
"""
from __future__ import annotations

from collections.abc import Iterator

from kvledger.router.chat import ChatTemplate
from kvledger.router.engine import EngineInfo, EngineRefusedError, Generated, Generation, cached_tokens_of
from kvledger.router.prompt_tokenizer import PromptTokenizer, engine_tokenizer
from kvledger.router.rank_client import RankDiedError
from kvledger.router.vllm_server import (CHAT_COMPLETIONS, COMPLETIONS, RESPONSES, EngineUnreachableError,
                                         VllmServer, VllmServerInfo)
from kvledger.worker.wire.messages import RankLoad


class VllmEngine:
    """One vLLM server under router rank ``rank`` (see the module docstring)."""

    def __init__(self, rank: int, server: VllmServer, found: VllmServerInfo, tokenizer: PromptTokenizer) -> None:
        """``server``'s data-parallel rank (``None``: a server without DP) is the engine core this engine is."""
        self._rank = rank
        self.server = server
        self._tokenizer = tokenizer
        self._info = self._info_of(found)

    @classmethod
    def connect_all(cls, first_rank: int, url: str, tokenizer_path: str | None = None,
                    timeout_s: float = 10.0) -> list[VllmEngine]:
        """Discover the server at ``url`` (``VllmServer.discover``), pick its tokenizer, and make one engine per
        data-parallel rank it runs, under ranks ``first_rank`` on (one engine without DP)."""
        server = VllmServer(url, timeout_s)
        try:
            found = server.discover()
            tokenizer = engine_tokenizer(server, found.model, found.model_root, tokenizer_path)
        except BaseException:
            server.close()
            raise
        if len(found.dp_ranks) == 1:
            return [cls(first_rank, server, found, tokenizer)]
        server.close()
        return [cls(first_rank + i, VllmServer(url, timeout_s, dp_rank=dp), found, tokenizer)
                for i, dp in enumerate(found.dp_ranks)]

    def _info_of(self, found: VllmServerInfo) -> EngineInfo:
        dp = self.server.dp_rank
        if dp is not None and dp not in found.dp_ranks:
            raise ValueError(f"vLLM server {found.url} runs data-parallel ranks {list(found.dp_ranks)}, not {dp}")
        self._blocks = found.num_blocks or 0
        return EngineInfo(found.model, found.block_size or 0, self._tokenizer, found.max_model_len, None,
                          ChatTemplate.of_model(found.model_root), frozenset(), "vllm", found.url,
                          found.events.get(0 if dp is None else dp), dp, found.connector)

    @property
    def rank(self) -> int:
        return self._rank

    def info(self, refresh: bool = False) -> EngineInfo:
        """What it serves; ``refresh`` asks it anew (a restarted server may publish elsewhere)."""
        if refresh:
            try:
                self._info = self._info_of(self.server.discover())
            except (EngineUnreachableError, ValueError) as e:
                raise RankDiedError(self._rank, f"it answers /health but not discovery: {e}") from e
        return self._info

    def healthy(self) -> bool:
        return self.server.healthy()

    def check(self, job: Generation) -> None:
        """The server checks its own input."""

    def _body(self, job: Generation) -> tuple[str, dict]:
        if job.responses:
            path, body = RESPONSES, {**job.fields, "model": self._info.model}
        else:
            path = CHAT_COMPLETIONS if job.chat else COMPLETIONS
            body = {**job.fields, "model": self._info.model, "max_tokens": job.max_tokens, "n": job.n,
                    "return_token_ids": True}
        if not job.chat:
            body["prompt"] = list(job.tokens)
        if job.cache_salt is not None:
            body["cache_salt"] = job.cache_salt
        return path, body

    def generate(self, job: Generation) -> Generated:
        path, body = self._body(job)
        try:
            status, answer = self.server.complete(body, path)
        except EngineUnreachableError as e:
            raise RankDiedError(self._rank, str(e)) from e
        if status != 200:
            raise EngineRefusedError(status, answer)
        first = answer["choices"][0] if answer.get("choices") else {}
        return Generated(answer, list(first.get("token_ids") or []), cached_tokens_of(answer))

    def stream(self, job: Generation) -> Iterator[dict | str]:
        """The server's own chunks, a usage chunk asked for (the router counts what it delivered; a Responses
        stream's last event carries its usage)."""
        path, body = self._body(job)
        usage = {} if job.responses else {"stream_options": {"include_usage": True}}
        events = self.server.stream({**body, "stream": True, **usage}, path)
        try:
            for ev in events:
                if isinstance(ev, dict) and "status" in ev and "error" in ev:
                    raise EngineRefusedError(ev["status"], ev["error"])
                yield ev
        except EngineUnreachableError as e:
            raise RankDiedError(self._rank, str(e)) from e

    def load(self) -> RankLoad:
        """Queue and KV usage from the server's ``/metrics``; its blocks from its cache config."""
        try:
            got = self.server.load()
        except EngineUnreachableError as e:
            raise RankDiedError(self._rank, str(e)) from e
        total = self._blocks
        used = min(total, round(got.kv_usage * total))
        onboard = got.onboard.s_per_block(self._info.block_size) if self._info.block_size else None
        return RankLoad(self._rank, True, True, 0, got.waiting, got.running, 0, used, total - used,
                        onboard_s_per_block=onboard)

    def close(self) -> None:
        self.server.close()
