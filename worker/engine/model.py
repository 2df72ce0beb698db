"""A tiny deterministic decoder that keeps its K/V in the paged pool: the ledger's oracle.

Weights come from a seeded CPU generator (no download, the same numbers on every
machine). Every new token's K/V is written into the pool slots the block table
names, and attention reads the whole context back from the pool, so positions
whose KV was reused, onboarded or migrated are read, never recomputed. Compute
is float32; K/V pass through the pool dtype on the way, so a path that reads
cached KV and a path that computes from scratch see the same numbers.

Layers may attend through a sliding window (``CacheConfig.attention_windows``,
a mix of window and full layers as Gemma-style models have): a query at
position ``p`` of a layer with a window of ``w`` tokens attends to the keys at
positions ``p - w < q <= p``. Each window keeps its own pools and its own row
of the block table; positions no query of the step reads may be placeholders
(``NO_BLOCK``, past every pool), as the ledger leaves them where a window's
blocks slid out. A slot outside the pool where the step reads raises
``ValueError``: never a silent read of another block's KV.

A LoRA id stands in for an adapter as a seeded vector added to the request's
token embeddings: it changes every K/V the request writes, which is what makes
KV computed under one adapter invalid under another, so the oracle catches a
ledger that shares blocks across adapters.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvledger.worker.engine.tokenizer import VOCAB_SIZE
from kvledger.worker.ledger.config import CacheConfig

ROPE_THETA = 10_000.0
RMS_EPS = 1e-6
#: Query heads per KV head (grouped-query attention).
GQA_GROUP = 2
#: MLP width as a multiple of the hidden size.
MLP_MULT = 2


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; linear weights are ``[in, out]`` so ``x @ w`` applies them."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    def to(self, device: torch.device) -> LayerWeights:
        return LayerWeights(*(getattr(self, f).to(device) for f in self.__slots__))


@dataclass(slots=True)
class DecoderWeights:
    """All weights; the LM head is separate from the embedding so outputs do not just echo the input."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def to(self, device: torch.device) -> DecoderWeights:
        return DecoderWeights(self.embed.to(device), [lw.to(device) for lw in self.layers],
                              self.final_norm.to(device), self.lm_head.to(device))


def query_heads(config: CacheConfig) -> int:
    """``GQA_GROUP`` query heads per KV head of the layer with the most; with KV heads varying by layer (VGQA), the
    least common multiple of the counts, so that every layer's query heads group evenly."""
    return GQA_GROUP * math.lcm(*config.kv_heads_per_layer)


def init_weights(config: CacheConfig, seed: int) -> DecoderWeights:
    """Seeded float32 CPU weights, scaled 1/sqrt(fan_in) so activations and logits stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    d = config.head_dim
    hidden = query_heads(config) * d

    def lin(n_in: int, n_out: int) -> torch.Tensor:
        return torch.randn(n_in, n_out, generator=g) / n_in ** 0.5

    def gain() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=g)

    embed = torch.randn(VOCAB_SIZE, hidden, generator=g)
    layers = [LayerWeights(attn_norm=gain(), wq=lin(hidden, hidden), wk=lin(hidden, kv * d), wv=lin(hidden, kv * d),
                           wo=lin(hidden, hidden), mlp_norm=gain(), w_gate=lin(hidden, MLP_MULT * hidden),
                           w_up=lin(hidden, MLP_MULT * hidden), w_down=lin(MLP_MULT * hidden, hidden))
              for kv in config.kv_heads_per_layer]
    return DecoderWeights(embed, layers, gain(), lin(hidden, VOCAB_SIZE))


def lora_vector(hidden: int, seed: int, lora_id: int) -> torch.Tensor:
    """The adapter of ``lora_id``: a float32 CPU vector ``[hidden]`` from a generator seeded by (seed, id)."""
    digest = hashlib.blake2b(f"kvledger/lora/{seed}/{lora_id}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "big") >> 1)
    return 0.5 * torch.randn(hidden, generator=g)


def rms_norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * gain


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of ``x [n, heads, dim]`` at absolute ``positions [n]``."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TinyDecoder:
    """Decoder-only transformer over paged KV pools ``[blocks, layers, K|V, tokens, kv_heads, head_dim]``: one pool,
    or one per KV head count where the layers' counts differ (``CacheConfig.pool_layouts``)."""

    def __init__(self, config: CacheConfig, seed: int = 0) -> None:
        if config.head_dim % 2:
            raise ValueError(f"TinyDecoder needs an even head_dim for rotary embeddings, got {config.head_dim}")
        self.config = config
        self.seed = seed
        self.weights = init_weights(config, seed)
        self._where = {layer: (i, at) for i, p in enumerate(config.pool_layouts) for at, layer in enumerate(p.layers)}
        """Layer -> (its pool, its index there)."""
        self._window_of = {layer: g for g, lay in enumerate(config.window_layouts) for layer in lay.layers}
        """Layer -> its attention window's index (``CacheConfig.window_layouts``)."""
        self._pool_window = [g for g, lay in enumerate(config.window_layouts) for _ in lay.pools]
        self._on_device: dict[torch.device, DecoderWeights] = {torch.device("cpu"): self.weights}
        self._lora: dict[tuple[torch.device, int], torch.Tensor] = {}

    def weights_on(self, device: torch.device) -> DecoderWeights:
        """The weights on ``device``, copied once: the model follows the pool wherever it lives."""
        if device not in self._on_device:
            self._on_device[device] = self.weights.to(device)
        return self._on_device[device]

    def lora_on(self, device: torch.device, lora_id: int) -> torch.Tensor:
        key = (device, lora_id)
        if key not in self._lora:
            self._lora[key] = lora_vector(self.weights.embed.shape[1], self.seed, lora_id).to(device)
        return self._lora[key]

    @torch.no_grad()
    def forward(self, pool: torch.Tensor | Sequence[torch.Tensor], block_table: torch.Tensor,
                chunks: Sequence[Sequence[int]], starts: Sequence[int],
                lora_ids: Sequence[int | None] | None = None) -> torch.Tensor:
        """Run one batched step and return float32 logits ``[sum(len(c)), vocab]`` on the pools' device.

        ``pool`` is the one pool, or the list of pools in ``pool_layouts`` order.

        Request ``i`` brings ``chunks[i]``, the tokens at positions
        ``[starts[i], starts[i] + len(chunks[i]))``, and its pool slots in row ``i``
        of ``block_table`` (``[batch, blocks]``; with several attention windows
        ``[batch, windows, blocks]``, as ``KVCacheManager.block_table`` gives it).
        Positions before ``starts[i]`` must already be in the pool (computed
        earlier or reused); they are read, not recomputed.
        ``lora_ids[i]`` (``None``: no adapter) must be the one the cached
        positions were computed under.
        Logits come in request order, one row per new token.
        """
        cfg = self.config
        pools = [pool] if isinstance(pool, torch.Tensor) else list(pool)
        shapes = cfg.block_shapes
        if len(pools) != len(shapes):
            raise ValueError(f"the model keeps its KV in {len(shapes)} pools, got {len(pools)}")
        windows = cfg.window_layouts
        for p, expected, g in zip(pools, shapes, self._pool_window):
            first = pools[self._pool_window.index(g)]
            if p.dim() != 6 or tuple(p.shape[1:]) != expected or p.shape[0] != first.shape[0]:
                raise ValueError(f"pool must have shape [blocks, *{expected}], got {tuple(p.shape)}")
        device = pools[0].device
        lens, starts_l = _check_chunks(chunks, starts, block_table, lora_ids)
        if (block_table.dim() == 3) != (len(windows) > 1) or block_table.dim() == 3 and block_table.shape[1] != len(
                windows):
            raise ValueError(f"the model has {len(windows)} attention windows: block_table must be "
                             f"{'[batch, windows, max_blocks]' if len(windows) > 1 else '[batch, max_blocks]'}, got "
                             f"{tuple(block_table.shape)}")
        w = self.weights_on(device)
        T = cfg.tokens_per_block
        batch = len(lens)
        ctx_lens = [s + n for s, n in zip(starts_l, lens)]
        max_new, max_ctx = max(lens), max(ctx_lens)

        table = block_table.to(device=device, dtype=torch.long)
        tables = [table] if table.dim() == 2 else list(table.unbind(1))
        needed = -(-max_ctx // T)
        if table.shape[-1] < needed:
            raise ValueError(f"block_table has {table.shape[-1]} columns; "
                             f"the longest context ({max_ctx} tokens) needs {needed}")
        ctx_len_t = torch.tensor(ctx_lens, device=device)
        start_t = torch.tensor(starts_l, device=device)
        len_t = torch.tensor(lens, device=device)

        # New tokens, flattened in request order, and where they sit in the padded batch.
        ids = torch.tensor([t for c in chunks for t in c], device=device, dtype=torch.long)
        row_of = torch.repeat_interleave(torch.arange(batch, device=device), len_t)
        first_of = torch.repeat_interleave(torch.cumsum(len_t, 0) - len_t, len_t)
        col_of = torch.arange(ids.numel(), device=device) - first_of
        pos = start_t[row_of] + col_of
        new_off = pos % T
        ctx_pos = torch.arange(max_ctx, device=device)
        ctx_off = torch.where(ctx_pos[None, :] < ctx_len_t[:, None], ctx_pos[None, :] % T, 0)
        # Query j of request i sits at position starts[i] + j and sees keys at positions <= its own.
        q_pos = start_t[:, None] + torch.arange(max_new, device=device)[None, :]
        views = [_window_view(tab, lay.window, pools[self._pool_window.index(g)].shape[0], ctx_pos, ctx_len_t,
                              start_t, q_pos, row_of, pos, T, ctx_lens)
                 for g, (tab, lay) in enumerate(zip(tables, windows))]

        d = cfg.head_dim
        heads = query_heads(cfg)
        x = w.embed[ids]
        if lora_ids is not None and any(lid is not None for lid in lora_ids):
            zero = w.embed.new_zeros(w.embed.shape[1])
            per_req = torch.stack([zero if lid is None else self.lora_on(device, lid) for lid in lora_ids])
            x = x + per_req[row_of]
        for layer, (lw, kv) in enumerate(zip(w.layers, cfg.kv_heads_per_layer)):
            p, at = self._where[layer]
            ctx_slot, new_slot, mask = views[self._window_of[layer]]
            h = rms_norm(x, lw.attn_norm)
            q = rope((h @ lw.wq).view(-1, heads, d), pos)
            k = rope((h @ lw.wk).view(-1, kv, d), pos)
            v = (h @ lw.wv).view(-1, kv, d)
            pools[p][new_slot, at, :, new_off] = torch.stack((k, v), dim=1).to(pools[p].dtype)
            ctx = pools[p][ctx_slot, at, :, ctx_off].to(torch.float32)  # [batch, max_ctx, 2, kv, d]
            k_ctx = ctx[:, :, 0].transpose(1, 2)
            v_ctx = ctx[:, :, 1].transpose(1, 2)
            q_pad = q.new_zeros(batch, max_new, heads, d)
            q_pad[row_of, col_of] = q
            att = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k_ctx, v_ctx, attn_mask=mask, enable_gqa=True)
            x = x + att.transpose(1, 2)[row_of, col_of].reshape(-1, heads * d) @ lw.wo
            h = rms_norm(x, lw.mlp_norm)
            x = x + (F.silu(h @ lw.w_gate) * (h @ lw.w_up)) @ lw.w_down
        return rms_norm(x, w.final_norm) @ w.lm_head


def _window_view(table: torch.Tensor, window: int | None, num_slots: int, ctx_pos: torch.Tensor,
                 ctx_len_t: torch.Tensor, start_t: torch.Tensor, q_pos: torch.Tensor, row_of: torch.Tensor,
                 pos: torch.Tensor, T: int, ctx_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One window's context slots ``[batch, max_ctx]``, new tokens' slots and attention mask from its table.

    Padding and the positions no query of the step attends to (below ``start - window + 1``, where a sliding
    window may hold placeholders) point at the slot of the request's first new token, which is written, so the
    gather never reads garbage; the mask hides them.
    """
    max_ctx = ctx_pos.numel()
    ctx_slot = table[:, :-(-max_ctx // T)].repeat_interleave(T, dim=1)[:, :max_ctx]
    first_new = table.gather(1, (start_t // T)[:, None])
    read = ctx_pos[None, :] < ctx_len_t[:, None]
    if window is not None:
        read &= ctx_pos[None, :] > start_t[:, None] - window
    ctx_slot = torch.where(read, ctx_slot, first_new)
    bad = read & ((ctx_slot < 0) | (ctx_slot >= num_slots))   # a step reads every position it writes
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"block_table row {row} names no valid pool slot (outside 0..{num_slots - 1}: a "
                         f"placeholder, padding or a bad slot) for a position below its context length "
                         f"{ctx_lens[row]} that the step reads")
    mask = ctx_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= ctx_pos[None, None, :] > q_pos[:, :, None] - window
    return ctx_slot, table[row_of, pos // T], mask[:, None]


def _check_chunks(chunks: Sequence[Sequence[int]], starts: Sequence[int], block_table: torch.Tensor,
                  lora_ids: Sequence[int | None] | None) -> tuple[list[int], list[int]]:
    """Validate the caller's batch before anything is written; return chunk lengths and starts."""
    if len(chunks) == 0:
        raise ValueError("forward needs at least one request")
    if len(starts) != len(chunks):
        raise ValueError(f"got {len(chunks)} chunks but {len(starts)} start positions")
    if block_table.dim() not in (2, 3) or block_table.shape[0] != len(chunks):
        raise ValueError(f"block_table must be [batch={len(chunks)}, max_blocks] (or [batch, windows, max_blocks]), "
                         f"got {tuple(block_table.shape)}")
    if block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
        raise TypeError(f"block_table must hold integer slots, got {block_table.dtype}")
    if lora_ids is not None:
        if len(lora_ids) != len(chunks):
            raise ValueError(f"got {len(chunks)} chunks but {len(lora_ids)} lora ids")
        for i, lid in enumerate(lora_ids):
            if lid is not None and (not isinstance(lid, int) or isinstance(lid, bool)):
                raise TypeError(f"lora_ids[{i}] must be an int or None, got {lid!r}")
    lens: list[int] = []
    starts_l: list[int] = []
    for i, (c, s) in enumerate(zip(chunks, starts)):
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise ValueError(f"starts[{i}] must be an int >= 0, got {s!r}")
        if len(c) == 0:
            raise ValueError(f"chunk {i} is empty; every request in a step brings at least one token")
        for t in c:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < VOCAB_SIZE:
                raise ValueError(f"chunk {i} holds token {t!r}; tokens are ints in 0..{VOCAB_SIZE - 1}")
        lens.append(len(c))
        starts_l.append(s)
    return lens, starts_l
