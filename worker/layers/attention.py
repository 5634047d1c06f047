"""Attention over a paged KV cache, for one step's flattened batch of decode tokens and prefill chunks.

The KV cache of a layer is two tensors of slots, `[num_blocks * block_size, kv_heads, head_dim]`;
slot = block_id * block_size + offset. Each step writes the new tokens' K/V into their slots
(`slot_mapping`) and attends over each sequence's context through its slots. This is the torch
reference path; it runs anywhere. A fused kernel can replace `paged_attention` on GPU.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk in the flat batch: tokens [start, end) at positions
    [num_cached, num_cached + end - start) of the sequence."""

    start: int
    end: int
    num_cached: int
    # [num_cached + end - start] slots of the whole context; None when nothing is cached, so the
    # chunk attends to its own fresh K/V.
    context_slots: torch.Tensor | None = None


@dataclass
class AttentionBatch:
    """How the flat batch of one step maps onto sequences. Decode tokens come first, one per
    sequence, then prefill chunks."""

    slot_mapping: torch.Tensor | None  # [T] slot for each new token's K/V; None: no cache
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [B, L_max] context slots, padded
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L_max] True where a slot is attended
    prefills: list[PrefillChunk] = field(default_factory=list)

    @classmethod
    def uncached_prompt(cls, num_tokens: int) -> "AttentionBatch":
        """A single prompt run start to end with no KV cache (for scoring and tests)."""
        return cls(slot_mapping=None, prefills=[PrefillChunk(0, num_tokens, 0)])


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,  # 2 x [num_slots, KVH, D]
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    if kv_cache is not None and batch.slot_mapping is not None:
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    n = batch.num_decodes
    if n:
        _, kv_heads, head_dim = k.shape
        groups = q.shape[1] // kv_heads
        keys = _gather(kv_cache[0], batch.decode_slots).transpose(1, 2)  # [B, KVH, L, D]
        values = _gather(kv_cache[1], batch.decode_slots).transpose(1, 2)
        # One query token per sequence: the query heads sharing a KV head ride in SDPA's "query
        # length" dimension, so K/V are never repeated per query head (HF's layout: query head
        # h uses KV head h // groups).
        out[:n] = F.scaled_dot_product_attention(
            q[:n].view(n, kv_heads, groups, head_dim),
            keys,
            values,
            attn_mask=batch.decode_mask,
            scale=scale,
        ).reshape(n, -1, head_dim)
    for c in batch.prefills:
        query = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if c.context_slots is None:
            keys = k[c.start : c.end]
            values = v[c.start : c.end]
            mask, causal = None, True
        else:
            keys = _gather(kv_cache[0], c.context_slots)
            values = _gather(kv_cache[1], c.context_slots)
            # query i sits at position num_cached + i and sees context positions 0..that
            rows = torch.arange(c.end - c.start).unsqueeze(1) + c.num_cached
            mask = torch.arange(keys.shape[0]).unsqueeze(0) <= rows
            causal = False
        out[c.start : c.end] = (
            F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1).unsqueeze(0),  # [1, KVH, L, D]
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )
            .squeeze(0)
            .transpose(0, 1)
        )
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a [num_slots, KVH, D] cache: [*slots.shape, KVH, D]. index_select over
    whole rows copies each slot's K or V in one piece, several times faster on CPU than
    advanced indexing."""
    rows = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[1:])
