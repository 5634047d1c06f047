"""Attention over a paged KV cache, for one step's flattened batch of decode tokens and prefill chunks.

The KV cache of a layer is two tensors of slots, `[num_blocks * block_size, kv_heads, head_dim]`;
slot = block_id * block_size + offset. Each step writes the new tokens' K/V into their slots
(`slot_mapping`) and attends over each sequence's context by gathering its blocks, whole, in
block-table order; a mask hides the unused tail of the last block. This is the torch reference
path; it runs anywhere. A fused kernel can replace `paged_attention` on GPU.
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
    # the blocks holding the whole context, positions [0, num_cached + end - start); None when
    # nothing is cached, so the chunk attends to its own fresh K/V.
    context_blocks: torch.Tensor | None = None


@dataclass
class AttentionBatch:
    """How the flat batch of one step maps onto sequences. Decode tokens come first, one per
    sequence, then prefill chunks."""

    slot_mapping: torch.Tensor | None  # [T] slot for each new token's K/V; None: no cache
    block_size: int = 16
    num_decodes: int = 0
    decode_blocks: torch.Tensor | None = None  # [B, N] block tables, padded
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, N * block_size] True where attended
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
        keys = _gather(kv_cache[0], batch.decode_blocks, batch.block_size).transpose(1, 2)
        values = _gather(kv_cache[1], batch.decode_blocks, batch.block_size).transpose(1, 2)
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
        if c.context_blocks is None:
            keys = k[c.start : c.end]
            values = v[c.start : c.end]
            mask, causal = None, True
        else:
            keys = _gather(kv_cache[0], c.context_blocks, batch.block_size)  # [L, KVH, D]
            values = _gather(kv_cache[1], c.context_blocks, batch.block_size)
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


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots of `blocks` ([..., N] block ids) from a [num_slots, KVH, D] cache, in order:
    [..., N * block_size, KVH, D]. index_select over whole blocks copies each in one piece, far
    faster on CPU than gathering slot by slot."""
    rows = cache.view(-1, block_size * cache[0].numel()).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *cache.shape[1:])
