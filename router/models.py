"""The models the router serves, built from each engine's ``info()``: names, tokenizers, chat templates, limits.

Each engine serves one model. A request names its model (none: the first
listed), is tokenized the way that model's engines tokenize (a chat rendered
by its template first), and is checked against what they could ever hold
before it is routed: a prompt longer than every engine's context is bad input
with the numbers, not a request to queue.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.router.engine import Engine, EngineInfo, Generation
from kvledger.router.engines import Engines
from kvledger.router.openai_types import ParamError
from kvledger.router.policies import NoLiveRankError
from kvledger.router.prompt_tokenizer import PromptTokenizer


class UnknownModelError(LookupError):
    """A request named a model no rank serves."""


@dataclass(frozen=True, slots=True)
class Model:
    """One model and the ranks serving it (live ones, and added engines that are down)."""

    name: str
    ranks: list[int]
    infos: list[EngineInfo]
    engine: Engine | None
    """A live engine serving it (``None``: none is live)."""

    @property
    def info(self) -> EngineInfo:
        return self.infos[0]

    def check(self, job: Generation) -> None:
        """Bad input for every engine of this model raises ``ParamError``/``ValueError`` now, before routing: a
        token outside the vocabulary, more tokens than any engine's context holds, what the engine refuses."""
        vocab = self.info.vocab_size
        if vocab is not None and max(job.tokens) >= vocab:
            raise ParamError("prompt", f"token {max(job.tokens)} is outside the vocabulary 0..{vocab - 1}")
        need = len(job.tokens) + job.max_tokens
        limits = [i.max_context for i in self.infos if i.max_context]
        if limits and need > max(limits):
            raise ParamError("prompt", f"this model's maximum context length is {max(limits)} tokens; the request "
                                       f"needs {need} ({len(job.tokens)} in the prompt, {job.max_tokens} to "
                                       "generate)")
        if self.engine is not None:
            self.engine.check(job)


class Models:
    """The catalogue over ``Engines`` (see the module docstring)."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self._seen: dict[str, list[EngineInfo]] = {}

    def catalogue(self) -> dict[str, Model]:
        """Model name -> its ``Model``, in rank order (own ranks first); a model whose engines are all down
        stays listed, with no ranks (a request for it finds no live rank, 503, rather than no model, 404)."""
        live = self.engines.live_engines()
        every: dict[int, Engine] = {**self.engines.added(), **live}
        ranks: dict[str, list[int]] = {}
        infos: dict[str, list[EngineInfo]] = {}
        for r in sorted(every):
            info = every[r].info()
            ranks.setdefault(info.model, []).append(r)
            infos.setdefault(info.model, []).append(info)
        self._seen.update(infos)
        return {name: Model(name, ranks.get(name, []), seen, next((live[r] for r in ranks.get(name, []) if r in live),
                                                                  None))
                for name, seen in self._seen.items()}

    def get(self, model: str | None) -> Model:
        """The model a request names, or the first listed; ``UnknownModelError`` for one nobody serves."""
        models = self.catalogue()
        if model is None:
            if not models:
                raise NoLiveRankError("no rank serves any model")
            return next(iter(models.values()))
        if model not in models:
            raise UnknownModelError(f"model {model!r} is not served here; models: {sorted(models)}")
        return models[model]

    def tokenizer(self, model: str) -> PromptTokenizer:
        """How text prompts for ``model`` are tokenized (the way its engines will)."""
        return self.get(model).info.tokenizer

    def encode(self, prompt: str | Sequence[int], model: str | None = None) -> tuple[str, list[int]]:
        """The model a request goes to and its prompt as token ids (text tokenized once, for that model)."""
        m = self.get(model)
        return m.name, m.info.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def encode_chat(self, messages: Sequence[dict], model: str | None = None, fields: dict | None = None,
                    add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The model a chat goes to and the tokens its engines will compute for it (``router.chat``), rendered
        with the request's ``fields`` (its tools and template options); the rendered text is tokenized with the
        special tokens only when asked, as vLLM tokenizes a chat (a Responses request: with them)."""
        m = self.get(model)
        template = m.info.chat_template
        if template is None:
            raise ParamError("messages", f"model {m.name!r} has no chat template (none in its "
                                         "tokenizer_config.json or chat_template.jinja); use /v1/completions")
        return m.name, m.info.tokenizer.encode(template.render(messages, fields), add_special_tokens=add_special_tokens)
