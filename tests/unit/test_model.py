"""The paged reference model against a dense recompute, and the byte tokenizer.

The dense reference below shares only the weights with ``kvledger.worker.engine.model``: it
recomputes the whole sequence with ordinary causal attention and no pool. K/V
are rounded through the pool dtype as the paged model stores them, so both see
the same numbers; logits then agree to float32 round-off (``ATOL``/``RTOL``:
the two differ only in the order of float32 sums). Pools start filled with NaN,
so a read of any position that was never written would poison the logits.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvledger.worker.engine.model import GQA_GROUP, ROPE_THETA, TinyDecoder, lora_vector, query_heads
from kvledger.worker.engine.tokenizer import BOS, EOS, PAD, VOCAB_SIZE, decode, encode
from kvledger.worker.ledger.config import CacheConfig

ATOL = RTOL = 1e-4

# The CUDA cases join where a GPU exists; CI has none, and runs them on the lent GPU machine.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_config(device: str = "cpu", dtype: torch.dtype = torch.float32, tokens_per_block: int = 4) -> CacheConfig:
    return CacheConfig(tokens_per_block=tokens_per_block, num_layers=2, num_kv_heads=2, head_dim=16,
                       dtype=dtype, device=device, num_primary_blocks=64)


def nan_pool(cfg: CacheConfig, blocks: int = 64) -> torch.Tensor:
    return torch.full((blocks, *cfg.block_shape), float("nan"), dtype=cfg.dtype, device=cfg.device)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def dense_logits(model: TinyDecoder, tokens: list[int], kv_dtype: torch.dtype,
                 lora_id: int | None = None) -> torch.Tensor:
    """Full causal recompute of ``tokens`` on CPU: float32 logits ``[len, vocab]``."""
    w = model.weights
    cfg = model.config
    d = cfg.head_dim
    heads = query_heads(cfg)
    n = len(tokens)
    pos = torch.arange(n, dtype=torch.float32)
    inv_freq = ROPE_THETA ** (-torch.arange(d // 2, dtype=torch.float32) / (d // 2))
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * g

    def rot(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    back = torch.arange(n)[:, None] - torch.arange(n)[None, :]   # query position - key position
    x = w.embed[torch.tensor(tokens)]
    if lora_id is not None:
        x = x + lora_vector(x.shape[1], model.seed, lora_id)
    for lw, kv_heads, window in zip(w.layers, cfg.kv_heads_per_layer, cfg.layer_windows):
        seen = causal if window is None else causal & (back < window)   # a window of w keys, the query's own included
        h = norm(x, lw.attn_norm)
        q = rot((h @ lw.wq).view(n, heads, d))
        k = rot((h @ lw.wk).view(n, kv_heads, d)).to(kv_dtype).float()
        v = (h @ lw.wv).view(n, kv_heads, d).to(kv_dtype).float()
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * d) @ lw.wo
        h = norm(x, lw.mlp_norm)
        x = x + (torch.nn.functional.silu(h @ lw.w_gate) * (h @ lw.w_up)) @ lw.w_down
    return norm(x, w.final_norm) @ w.lm_head


def table(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.cpu(), b.cpu(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_whole_prompt_in_one_chunk(device: str, dtype: torch.dtype) -> None:
    cfg = make_config(device, dtype)
    model = TinyDecoder(cfg, seed=3)
    toks = prompt(37, seed=1)
    pool = nan_pool(cfg)
    slots = [5, 2, 9, 0, 11, 7, 3, 30, 20, 1]  # 10 blocks cover 37 tokens at 4 per block
    out = model.forward(pool, table([slots], 12), [toks], [0])
    assert out.shape == (37, VOCAB_SIZE) and out.dtype == torch.float32 and out.device.type == device
    assert close(out, dense_logits(model, toks, dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [1, 4, 13, 36])
def test_cached_prefix_is_read_back_from_the_pool(device: str, dtype: torch.dtype, split: int) -> None:
    """First call writes the prefix; the second brings only the rest and must read the prefix's K/V."""
    cfg = make_config(device, dtype)
    model = TinyDecoder(cfg, seed=3)
    toks = prompt(37, seed=2)
    pool = nan_pool(cfg)
    bt = table([[8, 3, 60, 12, 1, 44, 2, 9, 17, 33]], 10)
    model.forward(pool, bt, [toks[:split]], [0])
    out = model.forward(pool, bt, [toks[split:]], [split])
    ref = dense_logits(model, toks, dtype)
    assert close(out, ref[split:])


def test_cached_prefix_poisoned_changes_the_answer() -> None:
    """Proves the second call reads the pool: corrupt the cached prefix and the logits move."""
    cfg = make_config()
    model = TinyDecoder(cfg, seed=3)
    toks = prompt(20, seed=4)
    pool = nan_pool(cfg)
    bt = table([[0, 1, 2, 3, 4]], 5)
    model.forward(pool, bt, [toks[:12]], [0])
    good = model.forward(pool.clone(), bt, [toks[12:]], [12])
    pool[1] += 1.0
    bad = model.forward(pool, bt, [toks[12:]], [12])
    assert not close(good, bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_of_three_with_shuffled_slots_and_cached_prefixes(device: str, dtype: torch.dtype) -> None:
    cfg = make_config(device, dtype)
    model = TinyDecoder(cfg, seed=5)
    prompts = [prompt(n, seed=10 + n) for n in (23, 5, 41)]
    slots = list(range(64))
    random.Random(0).shuffle(slots)
    rows = [slots[0:6], slots[6:8], slots[8:19]]
    bt = table(rows, 11)
    refs = [dense_logits(model, p, dtype) for p in prompts]

    pool = nan_pool(cfg)
    out = model.forward(pool, bt, prompts, [0, 0, 0])
    offsets = [0, 23, 28, 69]
    for i, ref in enumerate(refs):
        assert close(out[offsets[i]:offsets[i + 1]], ref), f"request {i}"

    # Same batch again on a fresh pool, now with different cached prefix lengths per request.
    pool = nan_pool(cfg)
    cached = [8, 0, 30]
    model.forward(pool, bt[[0, 2]], [prompts[0][:8], prompts[2][:30]], [0, 0])
    out = model.forward(pool, bt, [p[c:] for p, c in zip(prompts, cached)], cached)
    lens = [len(p) - c for p, c in zip(prompts, cached)]
    at = 0
    for i, (ref, c, n) in enumerate(zip(refs, cached, lens)):
        assert close(out[at:at + n], ref[c:]), f"request {i}"
        at += n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_one_token_at_a_time(device: str, dtype: torch.dtype) -> None:
    """Greedy decode through the pool gives the dense model's tokens and last logits at every step."""
    cfg = make_config(device, dtype)
    model = TinyDecoder(cfg, seed=7)
    toks = prompt(9, seed=7)
    pool = nan_pool(cfg)
    bt = table([[40, 3, 17, 22, 8, 51, 6]], 7)
    last = model.forward(pool, bt, [toks], [0])[-1]
    for _ in range(15):
        ref = dense_logits(model, toks, dtype)[-1]
        assert close(last, ref)
        nxt = int(last.argmax())
        assert nxt == int(ref.argmax())
        toks.append(nxt)
        last = model.forward(pool, bt, [[nxt]], [len(toks) - 1])[-1]


def test_batched_decode_of_different_lengths() -> None:
    cfg = make_config()
    model = TinyDecoder(cfg, seed=8)
    seqs = [prompt(n, seed=n) for n in (3, 10, 6)]
    pool = nan_pool(cfg)
    bt = table([[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11]], 5)
    model.forward(pool, bt, [s[:-1] for s in seqs], [0, 0, 0])
    out = model.forward(pool, bt, [[s[-1]] for s in seqs], [len(s) - 1 for s in seqs])
    for i, s in enumerate(seqs):
        assert close(out[i], dense_logits(model, s, cfg.dtype)[-1])


def test_lora_changes_kv_and_matches_dense_in_a_mixed_batch() -> None:
    cfg = make_config()
    model = TinyDecoder(cfg, seed=9)
    toks = prompt(14, seed=9)
    loras = [None, 3, 4, 3]
    pool = nan_pool(cfg)
    bt = table([[4 * i + j for j in range(4)] for i in range(4)], 4)
    out = model.forward(pool, bt, [toks] * 4, [0] * 4, lora_ids=loras).view(4, 14, -1)
    for i, lid in enumerate(loras):
        assert close(out[i], dense_logits(model, toks, cfg.dtype, lora_id=lid)), f"lora {lid}"
    assert torch.equal(out[1], out[3])
    assert not close(out[0], out[1]) and not close(out[1], out[2])
    assert not torch.equal(pool[bt[0, 0]], pool[bt[1, 0]])  # the adapter changes the K/V written


@pytest.mark.parametrize("device", DEVICES)
def test_layers_with_different_kv_heads_keep_their_kv_in_one_pool_per_count(device: str) -> None:
    """VGQA: layers 0 and 2 have two KV heads, layer 1 one, so there are two pools; prefilled in two chunks the
    model still equals the dense recompute, and each pool holds only its layers."""
    cfg = CacheConfig(tokens_per_block=4, num_layers=3, num_kv_heads_per_layer=(2, 1, 2), head_dim=16, dtype=torch.float32,
                      device=device, num_primary_blocks=16)
    model = TinyDecoder(cfg, seed=4)
    assert query_heads(cfg) == 4 and [lw.wk.shape[1] for lw in model.weights.layers] == [32, 16, 32]
    pools = [torch.full((16, *shape), float("nan"), device=device) for shape in cfg.block_shapes]
    assert [tuple(p.shape[1:]) for p in pools] == [(2, 2, 4, 2, 16), (1, 2, 4, 1, 16)]
    toks = prompt(13, seed=5)
    bt = table([[3, 0, 7, 12]], 4)
    model.forward(pools, bt, [toks[:6]], [0])
    out = model.forward(pools, bt, [toks[6:]], [6])
    assert close(out, dense_logits(model, toks, torch.float32)[6:])
    slots = [3, 0, 7, 12]
    for pool in pools:   # every position written in each pool, nothing elsewhere
        assert not torch.stack([pool[slots[i // 4], :, :, i % 4] for i in range(13)]).isnan().any()
        assert pool[1].isnan().all() and pool[12, :, :, 1:].isnan().all()
    with pytest.raises(ValueError, match="2 pools, got 1"):
        model.forward(pools[0], bt, [toks[:1]], [0])


@pytest.mark.parametrize("device", DEVICES)
def test_a_sliding_window_layer_reads_only_its_window_through_its_own_pool(device: str) -> None:
    """Gemma-style: layer 0 slides over 8 tokens, layer 1 attends to everything, each window with its own pool and
    row of the block table. The second chunk starts at 16: window 0's blocks 0 and 1 (positions 0..7) are
    placeholders, their old slots poisoned with NaN, and the logits still equal the dense windowed recompute."""
    cfg = CacheConfig(tokens_per_block=4, num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                      device=device, attention_windows=(8, None), window_blocks=((16, 0), (16, 0)))
    model = TinyDecoder(cfg, seed=6)
    pools = [torch.full((16, *shape), float("nan"), device=device) for shape in cfg.block_shapes]
    toks = prompt(21, seed=8)
    first = torch.tensor([[[5, 9, 2, 11, -1, -1], [0, 1, 2, 3, -1, -1]]], dtype=torch.int32)
    model.forward(pools, first, [toks[:16]], [0])
    pools[0][5] = pools[0][9] = float("nan")
    second = torch.tensor([[[-1, -1, 2, 11, 7, 8], [0, 1, 2, 3, 4, 5]]], dtype=torch.int32)
    out = model.forward(pools, second, [toks[16:]], [16])
    dense = dense_logits(model, toks, torch.float32)
    assert close(out, dense[16:])
    assert not close(dense[16:], dense_logits(TinyDecoder(make_config(device), seed=6), toks, torch.float32)[16:])
    with pytest.raises(ValueError, match="names no valid pool slot"):   # position 9 is read from 16 on
        model.forward(pools, torch.tensor([[[-1, -1, -1, 11, 7, 8], [0, 1, 2, 3, 4, 5]]], dtype=torch.int32),
                      [toks[16:]], [16])
    with pytest.raises(ValueError, match="2 attention windows"):
        model.forward(pools, second[:, 1], [toks[16:]], [16])


def test_weights_are_deterministic_per_seed() -> None:
    cfg = make_config()
    a, b, c = TinyDecoder(cfg, seed=1), TinyDecoder(cfg, seed=1), TinyDecoder(cfg, seed=2)
    assert torch.equal(a.weights.lm_head, b.weights.lm_head)
    assert torch.equal(a.weights.layers[1].wk, b.weights.layers[1].wk)
    assert not torch.equal(a.weights.embed, c.weights.embed)
    assert a.weights.embed.shape == (VOCAB_SIZE, GQA_GROUP * cfg.num_kv_heads * cfg.head_dim)


def test_bad_batches_are_rejected_before_anything_is_written() -> None:
    cfg = make_config()
    model = TinyDecoder(cfg)
    pool = torch.zeros((8, *cfg.block_shape), dtype=cfg.dtype)
    bt = table([[0, 1]], 2)
    cases: list[tuple[type[Exception], str, list[list[int]], list[int], torch.Tensor]] = [
        (ValueError, "no valid pool slot", [[1] * 5], [0], table([[0, -1]], 2)),
        (ValueError, "no valid pool slot", [[1] * 5], [0], table([[0, 8]], 2)),
        (ValueError, "columns", [[1] * 9], [0], bt),
        (ValueError, "outside|tokens are ints", [[1, VOCAB_SIZE]], [0], bt),
        (ValueError, "tokens are ints", [[1, -1]], [0], bt),
        (ValueError, "empty", [[]], [0], bt),
        (ValueError, "start positions", [[1]], [0, 0], bt),
        (ValueError, "starts\\[0\\]", [[1]], [-1], bt),
        (ValueError, "batch=2", [[1], [2]], [0, 0], bt),
        (ValueError, "at least one", [], [], table([], 2).view(0, 2)),
        (TypeError, "integer slots", [[1]], [0], bt.float()),
    ]
    for exc, msg, chunks, starts, t in cases:
        with pytest.raises(exc, match=msg):
            model.forward(pool, t, chunks, starts)
    with pytest.raises(ValueError, match="lora ids"):
        model.forward(pool, bt, [[1]], [0], lora_ids=[1, 2])
    with pytest.raises(TypeError, match="lora_ids\\[0\\]"):
        model.forward(pool, bt, [[1]], [0], lora_ids=["a"])  # type: ignore[list-item]
    assert not pool.any()
    with pytest.raises(ValueError, match="pool must have shape"):
        model.forward(torch.zeros(8, 3), bt, [[1]], [0])
    with pytest.raises(ValueError, match="even head_dim"):
        TinyDecoder(CacheConfig(head_dim=5, device="cpu", num_primary_blocks=1))


# --- tokenizer -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "hello, world", "naïve café", "日本語のテキスト",
                                  "emoji 🙂🚀 mix\n\ttabs", "\x00nul"])
def test_tokenizer_round_trip(text: str) -> None:
    ids = encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert decode(ids) == text
    assert encode(text, add_bos=True) == [BOS, *ids]
    assert decode([BOS, *ids, EOS, PAD, VOCAB_SIZE - 1]) == text


def test_tokenizer_prefixes_and_broken_utf8() -> None:
    assert encode("abcdef")[:3] == encode("abc")
    assert decode(encode("é")[:1]) == "\ufffd"
    assert decode(torch.tensor(encode("tensor ids"))) == "tensor ids"
    assert VOCAB_SIZE > max(BOS, EOS, PAD)


@pytest.mark.parametrize("bad, exc", [(b"bytes", TypeError), (None, TypeError), (["a"], TypeError),
                                      ("lone \ud800 surrogate", ValueError)])
def test_encode_rejects(bad: object, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        encode(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad, exc", [([VOCAB_SIZE], ValueError), ([-1], ValueError), ([1.0], TypeError),
                                      ([True], TypeError), ("abc", TypeError), (b"abc", TypeError),
                                      (None, TypeError), ([1, "2"], TypeError)])
def test_decode_rejects(bad: object, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        decode(bad)  # type: ignore[arg-type]
