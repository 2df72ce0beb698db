"""The reference engine: a tiny paged decoder that runs over a ledger's block tables (the oracle).

``tokenizer`` is torch-free and the router imports it to turn text into token
ids; the engine itself (``ReferenceEngine``, ``TinyDecoder``) is loaded on
first use, so that import does not pull in torch.
"""
from __future__ import annotations

import importlib

_LAZY = {"ReferenceEngine": "reference", "TinyDecoder": "model"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = list(_LAZY)
