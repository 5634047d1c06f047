import os
import subprocess
import sys

from meridian.worker.engine.block_manager import BlockManager, prefix_block_hashes
from meridian.worker.engine.sequence import Sequence
from meridian.worker.sampling_params import SamplingParams

BS = 4


def seq(tokens, rid="r", arrival=0):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8), arrival)


def computed(bm: BlockManager, s: Sequence) -> None:
    """Pretend the model ran over every token of s."""
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)


def test_allocate_takes_ceil_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = seq(range(9))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert len(set(s.block_table)) == 3
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_can_allocate_refuses_when_pool_too_small():
    bm = BlockManager(num_blocks=2, block_size=BS)
    assert not bm.can_allocate(seq(range(9)))
    assert bm.can_allocate(seq(range(8)))


def test_append_slot_allocates_only_at_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=BS)
    s = seq(range(4))
    bm.allocate(s)
    computed(bm, s)
    s.token_ids.append(99)  # fifth token needs a second block
    assert bm.can_append(s)
    bm.append_slot(s)
    assert len(s.block_table) == 2
    s.token_ids.append(100)
    bm.append_slot(s)  # still fits in block 2
    assert len(s.block_table) == 2


def test_can_append_false_when_no_free_block():
    bm = BlockManager(num_blocks=1, block_size=BS)
    s = seq(range(4))
    bm.allocate(s)
    s.token_ids.append(5)
    assert not bm.can_append(s)


def test_prefix_reuse_shares_leading_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq(range(10), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq([*range(8), 50, 51, 52], "b")
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]  # two full shared blocks
    assert b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_hits == 8


def test_prefix_hit_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq(range(8), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(8), "b")  # identical prompt: the last block must be recomputed for logits
    bm.allocate(b)
    assert b.num_computed_tokens == 4


def test_different_prefix_with_same_block_does_not_hit():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    bm.allocate(a)
    computed(bm, a)
    # second block's tokens equal a's, but its parent differs: the chain hash must not match
    b = seq([0, 0, 0, 0, 5, 6, 7, 8, 9], "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_uncomputed_blocks_are_not_reusable():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = seq(range(9), "a")
    bm.allocate(a)  # K/V not written yet
    b = seq(range(9), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_freed_blocks_stay_cached_until_needed():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(range(9), "a")
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq(range(9), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 8  # both full blocks came back from the cache


def test_empty_free_blocks_used_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(range(5), "a")  # one full block (cached after free) + one partial
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = seq(range(100, 108), "b")  # needs 2 of the 3 uncached-free blocks
    bm.allocate(b)
    c = seq(range(5), "c")
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.num_computed_tokens == 4  # a's first block survived


def test_lru_eviction_order():
    bm = BlockManager(num_blocks=2, block_size=BS)
    old, new = seq(range(5), "old"), seq(range(10, 15), "new")
    for s in (old,):
        bm.allocate(s)
        computed(bm, s)
        bm.free(s)
    bm.allocate(new)
    computed(bm, new)
    bm.free(new)
    # both blocks are cached-free now; one more allocation must evict `old`'s block first
    x = seq(range(20, 23), "x")
    bm.allocate(x)
    hashes_old = prefix_block_hashes(list(range(4)), BS)
    hashes_new = prefix_block_hashes(list(range(10, 14)), BS)
    cached = set(bm.cached_block_hashes())
    assert hashes_old[0] not in cached
    assert hashes_new[0] in cached


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = seq(range(9), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(9), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert bm.cached_block_hashes() == []


def test_block_hash_is_stable_across_processes():
    # a gateway computes the same hashes to know which worker holds a prefix
    code = "from meridian.worker.engine.block_manager import prefix_block_hashes as h; print(h(list(range(40)), 16))"
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == str(prefix_block_hashes(list(range(40)), 16))
    assert prefix_block_hashes([1, 2, 3, 4], 4) == prefix_block_hashes([1, 2, 3, 4, 5], 4)
