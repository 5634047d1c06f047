"""The paged KV cache's bookkeeping (plain Python: no torch).

The cache is a pool of `num_blocks` blocks of `block_size` token slots. Each sequence holds a block
table; blocks are reference-counted so sequences can share them. Prefix caching: a full block whose
K/V are computed is registered under the hash of (parent block's hash, its token ids), so a later
sequence with the same leading tokens reuses those blocks instead of recomputing them. Freed blocks
keep their contents and hash, and are evicted least-recently-freed first, only when the pool needs
them; free blocks that hold nothing reusable are handed out before any cached one.
"""

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from meridian.worker.engine.sequence import Sequence

ROOT_HASH = 0


def block_hash(parent: int, token_ids: list[int]) -> int:
    """Stable 64-bit identity of a full block given everything before it (same in every process,
    so a gateway can compute which prefixes a worker holds)."""
    data = parent.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids`, in order."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and computed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_empty: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._by_hash: dict[int, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_empty) + len(self._free_cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_block_hashes(self) -> list[int]:
        """Hashes of every block whose contents can be reused now (in use or free)."""
        return list(self._by_hash)

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """(block ids, hashes) of seq's leading full blocks already in the cache. The last token is
        always left to compute, because its logits are needed to sample."""
        if not self.enable_prefix_caching:
            return [], []
        usable = (seq.num_tokens - 1) // self.block_size
        hits, hashes = [], []
        for h in prefix_block_hashes(seq.token_ids[: usable * self.block_size], self.block_size):
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(h)
        return hits, hashes

    # ---- check / act pairs ---------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _ = self._match_prefix(seq)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(seq.num_tokens) - len(hits)
        return needed + reused_free <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its current tokens, reusing cached leading blocks."""
        assert not seq.block_table, f"{seq} already holds blocks"
        hits, hashes = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
        new = [self._take_free() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits))]
        seq.block_table = hits + new
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.block_hashes = hashes
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_computed_tokens

    def can_append(self, seq: Sequence) -> bool:
        return not self._needs_block(seq) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for seq's newest token's K/V."""
        if self._needs_block(seq):
            seq.block_table.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        # Release the tail first so that, under pressure, a shared prefix outlives its suffixes.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_empty.append(block_id)
                else:
                    self._free_cached[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.block_hashes = []

    def commit(self, seq: Sequence) -> None:
        """Register seq's newly completed full blocks in the prefix cache (after their K/V exist)."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            h = block_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            # Two sequences may compute the same block at once; the first one registered serves.
            if h not in self._by_hash and block.hash is None:
                block.hash = h
                self._by_hash[h] = block.block_id

    # ---- internals -----------------------------------------------------------------------------

    def _needs_block(self, seq: Sequence) -> bool:
        return seq.num_tokens > len(seq.block_table) * self.block_size

    def _take_free(self) -> int:
        if self._free_empty:
            block_id = self._free_empty.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)  # evict least recently freed
            block = self.blocks[block_id]
            del self._by_hash[block.hash]
            block.hash = None
        self.blocks[block_id].ref_count = 1
        return block_id
