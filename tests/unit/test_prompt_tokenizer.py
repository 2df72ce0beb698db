"""The router tokenizes a text prompt into the ids its engine computes, or no probe ever matches: ``HfTokenizer``
against the ``tokenizers`` library's own ``encode`` on a model's ``tokenizer.json`` with special tokens and a
template that adds one."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from kvledger.router.prompt_tokenizer import HfTokenizer

TEXTS = ["", "hello world", "the quick brown fox jumps over the lazy dog " * 40, "naïve café — 東京 🚀",
         "<s> inside the text </s>, twice: <s>", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n"]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    """A word-level tokenizer over a small vocabulary (unknown words to ``<unk>``), ``<s>`` added in front of a
    single text, as a Llama tokenizer adds its BOS."""
    words = sorted({w for t in TEXTS for w in t.replace(",", " ").split()})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words[:-3])}}   # three unknown
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("model") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_prompt_becomes_the_ids_the_library_encodes(tokenizer_json, add_special_tokens):
    reference = Tokenizer.from_file(tokenizer_json)
    ours = HfTokenizer(tokenizer_json)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == reference.encode(text, add_special_tokens=add_special_tokens).ids
    assert ours.encode("hello world")[0] == 1 and ours.encode("hello world", False)[0] != 1
