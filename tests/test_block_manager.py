"""Tests of the KV-cache BlockManager: ref counts, prefix caching, LRU eviction, fork, traces."""

import copy
import random

import pytest

from fastgen.engine.block_manager import BlockManager, PrefixCacheStats

BS = 4


def snapshot(bm: BlockManager) -> dict:
    """Deep copy of all of the manager's state, to prove an operation changed nothing."""
    return copy.deepcopy(vars(bm))


def test_constructor_and_argument_validation():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    with pytest.raises(TypeError, match="num_blocks"):
        BlockManager(2.5, 4)
    with pytest.raises(TypeError, match="block_size"):
        BlockManager(4, True)
    bm = BlockManager(4, BS)
    assert bm.num_free_blocks == 4
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="num_tokens"):
        bm.blocks_needed(-1)
    with pytest.raises(ValueError, match="unknown seq_id 7"):
        bm.block_table(7)
    with pytest.raises(ValueError, match="unknown seq_id 7"):
        bm.slot(7, 0)
    with pytest.raises(ValueError, match="unknown seq_id 7"):
        bm.fork(7, 8, 1)
    with pytest.raises(ValueError, match="empty"):
        bm.match_prefix(1, [])
    with pytest.raises(ValueError, match="exceeds len"):
        bm.allocate(1, [1, 2], 3)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate(1, [1, 2], -1)
    with pytest.raises(TypeError, match="seq_id"):
        bm.allocate("a", [1, 2], 1)
    with pytest.raises(ValueError, match="block_id"):
        bm.ref_count(4)
    assert bm.match_prefix(1, [1, 2, 3]) == 0
    with pytest.raises(ValueError, match="already has blocks"):
        bm.match_prefix(1, [1, 2, 3])
    assert bm.allocate(1, [1, 2, 3, 4, 5, 6], 6)
    with pytest.raises(ValueError, match="position 8"):
        bm.slot(1, 8)
    with pytest.raises(ValueError, match="position"):
        bm.slot(1, -1)
    bm.free(1)
    bm.free(1)  # freeing an unknown (already freed) sequence is a no-op
    assert bm.num_free_blocks == 4


def test_block_table_and_slots():
    bm = BlockManager(8, BS)
    tokens = list(range(10))
    assert bm.allocate(0, tokens, 10)
    table = bm.block_table(0)
    assert len(table) == 3 and len(set(table)) == 3
    assert [bm.slot(0, p) for p in range(12)] == [table[p // BS] * BS + p % BS for p in range(12)]
    table.append(99)  # a copy: the manager's table is unaffected
    assert len(bm.block_table(0)) == 3
    # num_tokens below the current coverage is a no-op that succeeds.
    assert bm.allocate(0, tokens, 3)
    assert bm.block_table(0) == table[:3]
    assert bm.num_free_blocks == 5


def test_prefix_hits_exact_token_counts():
    bm = BlockManager(16, BS)
    a = list(range(10))
    assert bm.match_prefix(0, a) == 0
    assert bm.allocate(0, a, 10)  # two full blocks registered, third block partial
    a_table = bm.block_table(0)

    assert bm.match_prefix(1, a + [50, 51, 52, 53]) == 8
    assert bm.block_table(1) == a_table[:2]
    assert [bm.ref_count(b) for b in a_table] == [2, 2, 1]
    # The result is capped at len - 1, rounded down to whole blocks.
    assert bm.match_prefix(2, a[:8]) == 4
    assert bm.match_prefix(3, a[:9]) == 8
    assert bm.match_prefix(4, a[:4]) == 0
    assert bm.match_prefix(5, a[:2] + [77] + a[3:]) == 0  # first block differs
    assert bm.match_prefix(6, a[:6] + [77] + a[7:]) == 4  # second block differs
    assert bm.stats == PrefixCacheStats(requests=7, queries=10 + 14 + 8 + 9 + 4 + 10 + 10,
                                        hits=8 + 4 + 8 + 4, evictions=0)
    assert bm.stats.hit_rate == pytest.approx(24 / 65)
    for seq_id in range(7):
        bm.free(seq_id)
    assert bm.num_free_blocks == 16
    assert all(bm.ref_count(b) == 0 for b in range(16))


def test_partial_last_block_never_shared():
    bm = BlockManager(16, BS)
    a = [7, 7, 7, 7, 8, 8, 8, 8, 9]
    assert bm.allocate(0, a, 6)  # block 1 holds only 2 of its 4 tokens
    assert bm.match_prefix(1, a) == 4
    assert bm.block_table(1) == bm.block_table(0)[:1]
    assert bm.allocate(1, a, 9)
    assert bm.block_table(1)[1] != bm.block_table(0)[1]
    assert bm.ref_count(bm.block_table(0)[1]) == 1
    # Once block 1 of seq 0 is full it is shared too (seq 1 registered an identical block
    # concurrently and keeps its own).
    assert bm.allocate(0, a, 8)
    assert bm.match_prefix(2, a) == 8
    assert bm.block_table(2)[0] == bm.block_table(0)[0]
    assert bm.block_table(2)[1] in (bm.block_table(0)[1], bm.block_table(1)[1])


def test_chained_hash_same_block_after_different_prefix():
    bm = BlockManager(16, BS)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert bm.allocate(0, a, 9)
    b = [9, 9, 9, 9, 5, 6, 7, 8, 9]  # block 1 identical to a's block 1, after another block 0
    assert bm.match_prefix(1, b) == 0
    assert bm.allocate(1, b, 9)
    assert bm.block_table(1)[1] != bm.block_table(0)[1]
    assert bm.match_prefix(2, b) == 8
    assert bm.block_table(2) == bm.block_table(1)[:2]
    assert bm.match_prefix(3, a) == 8
    assert bm.block_table(3) == bm.block_table(0)[:2]
    # Identical contents at a different position (block 1 moved to block 0) do not match.
    assert bm.match_prefix(4, [5, 6, 7, 8, 1, 2, 3, 4, 0]) == 0


class CollidingToken(int):
    """A token id whose hash is constant, so every cache key of equal length collides."""

    def __hash__(self) -> int:
        return 0


def test_hash_collisions_never_give_false_hits():
    bm = BlockManager(64, BS)
    rng = random.Random(0)
    # Prefixes whose blocks are equal in content at some index but differ in chain.
    prefixes = [[0, 1, 0, 1, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 0, 1, 0, 1]]
    written = {}
    hits = []
    for seq_id in range(9):
        tokens = [CollidingToken(t) for t in prefixes[seq_id % 3] + [rng.randrange(2) for _ in range(5)]]
        hit = bm.match_prefix(seq_id, tokens)
        hits.append(hit)
        for pos in range(hit):
            assert written[bm.slot(seq_id, pos)] == tokens[pos]
        assert bm.allocate(seq_id, tokens, 13)
        for pos in range(hit, 13):
            written[bm.slot(seq_id, pos)] = tokens[pos]
    assert hits[:3] == [0, 4, 0]  # the second prefix shares only block 0 with the first
    assert all(hit >= 8 for hit in hits[3:])  # equal prefixes still hit


def test_duplicate_concurrent_full_blocks():
    bm = BlockManager(16, BS)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    assert bm.match_prefix(0, tokens) == 0
    assert bm.match_prefix(1, tokens) == 0
    assert bm.allocate(0, tokens, 4)
    assert bm.allocate(1, tokens, 4)  # registers the same full block: keeps its own, no error
    first0, first1 = bm.block_table(0)[0], bm.block_table(1)[0]
    assert first0 != first1
    assert bm.num_cached_blocks == 1
    # seq 1's next block chains onto the cached twin of its own first block.
    assert bm.allocate(1, tokens, 8)
    assert bm.match_prefix(2, tokens) == 8
    assert bm.block_table(2) == [first0, bm.block_table(1)[1]]
    bm.free(1)  # its unregistered twin goes straight back to the free list
    assert bm.num_cached_blocks == 2
    bm.free(0)
    bm.free(2)
    assert bm.num_free_blocks == 16


def test_lru_eviction_order():
    bm = BlockManager(4, BS)
    seqs = {s: [10 * s + i for i in range(4)] for s in range(4)}
    for s, tokens in seqs.items():
        assert bm.allocate(s, tokens, 4)
    blocks = {s: bm.block_table(s)[0] for s in seqs}
    for s in (0, 1, 2):
        bm.free(s)
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 4
    # Matching seq 1's block again makes it the most recently used.
    assert bm.match_prefix(10, seqs[1] + [0]) == 4
    bm.free(10)
    assert bm.allocate(11, [0] * 4, 1)
    assert bm.block_table(11) == [blocks[0]]  # least recently freed
    assert bm.stats.evictions == 1
    assert bm.allocate(12, [0] * 4, 1)
    assert bm.block_table(12) == [blocks[2]]  # seq 1 was touched after seq 2 was freed
    assert bm.match_prefix(13, seqs[0] + [0]) == 0
    assert bm.match_prefix(14, seqs[2] + [0]) == 0
    assert bm.match_prefix(15, seqs[1] + [0]) == 4
    assert bm.stats.evictions == 2


def test_eviction_takes_tail_blocks_first():
    bm = BlockManager(3, BS)
    tokens = list(range(13))
    assert bm.allocate(0, tokens, 12)
    table = bm.block_table(0)
    bm.free(0)
    assert bm.allocate(1, [0] * 4, 4)
    assert bm.block_table(1) == [table[2]]
    assert bm.match_prefix(2, tokens) == 8


def test_free_blocks_used_before_evicting_cached_ones():
    bm = BlockManager(2, BS)
    tokens = [5, 5, 5, 5, 6]
    assert bm.allocate(0, tokens, 5)  # block 0 full and cached, block 1 partial
    partial = bm.block_table(0)[1]
    bm.free(0)
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 1
    assert bm.allocate(1, [1] * 4, 4)
    assert bm.block_table(1) == [partial]
    assert bm.stats.evictions == 0
    assert bm.match_prefix(2, tokens) == 4


def test_cached_blocks_reused_after_preemption():
    bm = BlockManager(8, BS)
    tokens = list(range(14))
    assert bm.match_prefix(0, tokens) == 0
    assert bm.allocate(0, tokens, 8)
    assert bm.allocate(0, tokens, 14)
    table = bm.block_table(0)
    bm.free(0)  # preempted
    assert bm.num_free_blocks == 8
    assert bm.match_prefix(0, tokens) == 12  # cheap resume: its own three full blocks
    assert bm.block_table(0) == table[:3]
    assert bm.num_free_blocks == 5
    assert bm.allocate(0, tokens, 14)
    assert bm.block_table(0)[:3] == table[:3]


def test_namespaces_never_share_blocks():
    """The same tokens computed another way (LongRoPE's long factors) live in their own namespace."""
    bm = BlockManager(16, BS)
    tokens = list(range(13))
    assert bm.match_prefix(0, tokens) == 0 and bm.allocate(0, tokens, 13)
    assert bm.match_prefix(1, tokens, namespace=1) == 0  # namespace 0's blocks are invisible
    assert bm.allocate(1, tokens, 13, namespace=1) and bm.namespace(1) == 1 and bm.namespace(0) == 0
    assert set(bm.block_table(0)).isdisjoint(bm.block_table(1))
    assert bm.match_prefix(2, tokens, namespace=1) == 12 and bm.block_table(2) == bm.block_table(1)[:3]
    assert bm.match_prefix(3, tokens) == 12 and bm.block_table(3) == bm.block_table(0)[:3]
    assert bm.fork(1, 4, 13) == 12 and bm.namespace(4) == 1
    with pytest.raises(ValueError, match="namespace 1, not 0"):
        bm.allocate(4, tokens, 13)
    assert bm.namespace(9) is None
    for seq_id in range(5):
        bm.free(seq_id)
    assert bm.num_free_blocks == 16


def test_fork():
    bm = BlockManager(16, BS)
    tokens = list(range(10))
    assert bm.allocate(0, tokens, 10)
    parent = bm.block_table(0)
    assert bm.fork(0, 1, 10) == 8
    assert bm.block_table(1) == parent[:2]
    assert [bm.ref_count(b) for b in parent] == [2, 2, 1]
    assert bm.fork(0, 2, 8) == 4  # capped at num_tokens - 1
    assert bm.fork(0, 3, 1) == 0 and bm.block_table(3) == []
    with pytest.raises(ValueError, match="already has blocks"):
        bm.fork(0, 1, 10)
    with pytest.raises(ValueError, match="exceeds"):
        bm.fork(0, 4, 11)
    # The child writes its own tail and continues the parent's hash chain.
    child = tokens + [40, 41]
    assert bm.allocate(1, child, 12)
    assert bm.block_table(1)[2] != parent[2]
    assert {bm.slot(1, p) for p in range(8, 12)}.isdisjoint({bm.slot(0, p) for p in range(8, 12)})
    assert bm.match_prefix(5, child + [0]) == 12
    for seq_id in (0, 1, 2, 3, 5):
        bm.free(seq_id)
    assert bm.num_free_blocks == 16
    assert all(bm.ref_count(b) == 0 for b in range(16))


def test_fork_without_prefix_caching():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    tokens = list(range(9))
    assert bm.allocate(0, tokens, 9)
    assert bm.fork(0, 1, 9) == 8
    assert bm.block_table(1) == bm.block_table(0)[:2]
    bm.free(0)
    assert bm.num_free_blocks == 6
    bm.free(1)
    assert bm.num_free_blocks == 8


def test_failed_allocate_changes_nothing():
    bm = BlockManager(4, BS)
    a = list(range(12))
    assert bm.allocate(0, a, 12)
    b = [9] * 4
    assert bm.allocate(1, b, 4)
    bm.free(1)  # one cached unreferenced block: evictable but not enough
    assert bm.match_prefix(2, [1] * 9) == 0
    before = snapshot(bm)
    assert not bm.can_allocate(2, 9)
    assert not bm.allocate(2, [1] * 9, 9)
    assert snapshot(bm) == before
    assert not bm.allocate(0, a + [1] * 8, 20)  # a known sequence growing too far
    assert snapshot(bm) == before
    assert bm.can_allocate(2, 4)
    # More blocks than exist in total can never be had.
    empty = BlockManager(4, BS)
    assert not empty.can_allocate(0, 17) and empty.can_allocate(0, 16)
    assert empty.blocks_needed(17) > empty.num_blocks


def test_prefix_caching_disabled():
    bm = BlockManager(3, BS, enable_prefix_caching=False)
    tokens = list(range(9))
    assert bm.match_prefix(0, tokens) == 0
    assert bm.allocate(0, tokens, 9)
    table = bm.block_table(0)
    assert bm.match_prefix(1, tokens) == 0
    assert bm.block_table(1) == []
    assert bm.num_cached_blocks == 0
    bm.free(0)
    assert bm.match_prefix(2, tokens) == 0
    # Freed blocks went straight back to the free list: nothing is cached or evicted.
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 0
    assert bm.allocate(2, tokens, 9)
    assert set(bm.block_table(2)) == set(table)
    assert bm.stats == PrefixCacheStats()


def test_reset_prefix_cache():
    bm = BlockManager(8, BS)
    tokens = list(range(9))
    assert bm.allocate(0, tokens, 9)
    assert bm.allocate(1, [5] * 4, 4)
    bm.free(1)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 5
    assert bm.match_prefix(2, tokens) == 0
    assert bm.block_table(0)[0] not in bm.block_table(2)
    bm.free(0)
    bm.free(2)
    assert bm.num_free_blocks == 8
    assert bm.allocate(3, tokens, 9)
    assert bm.match_prefix(4, tokens) == 8  # caching works again after a reset


class Trace:
    """A mini scheduler driving a BlockManager, with a shadow KV cache (slot -> token written)."""

    def __init__(self, seed: int, enable: bool) -> None:
        self.rng = random.Random(seed)
        self.enable = enable
        self.num_blocks = 40
        self.bm = BlockManager(self.num_blocks, BS, enable_prefix_caching=enable)
        # A 3-token vocabulary makes equal blocks after different prefixes common.
        self.prefixes = [self.rand_tokens(self.rng.randrange(1, 20)) for _ in range(4)]
        self.shadow: dict[int, int | None] = {}
        self.running: dict[int, list] = {}  # seq_id -> [token_ids, num_computed]
        self.waiting: dict[int, list[int]] = {}  # new or preempted: token_ids
        self.next_id = 0
        self.counts = {"hits": 0, "failed": 0, "forks": 0, "finished": 0}

    def rand_tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3) for _ in range(n)]

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def add(self) -> None:
        if len(self.waiting) < 6:
            prefix = self.rng.choice(self.prefixes + [[]])
            self.waiting[self.new_id()] = prefix + self.rand_tokens(self.rng.randrange(1, 16))

    def schedule(self) -> None:
        if not self.waiting or len(self.running) >= 8:
            return
        seq_id = self.rng.choice(list(self.waiting))
        tokens = self.waiting.pop(seq_id)
        hit = self.bm.match_prefix(seq_id, tokens)
        assert hit % BS == 0 and 0 <= hit <= len(tokens) - 1
        if not self.enable:
            assert hit == 0
        # The matched blocks really hold these tokens' KV.
        for pos in range(hit):
            assert self.shadow.get(self.bm.slot(seq_id, pos)) == tokens[pos]
        self.counts["hits"] += hit
        self.running[seq_id] = [tokens, hit]
        self.step(seq_id)

    def step(self, seq_id: int | None = None) -> None:
        if not self.running:
            return
        if seq_id is None:
            seq_id = self.rng.choice(list(self.running))
        tokens, computed = self.running[seq_id]
        if computed == len(tokens):
            tokens.append(self.rng.randrange(3))  # the token sampled last step, now decoded
        target = min(len(tokens), computed + self.rng.randint(1, 9))
        old_table = self.bm.block_table(seq_id)
        before = snapshot(self.bm)
        expected = self.bm.can_allocate(seq_id, target)
        ok = self.bm.allocate(seq_id, tokens, target)
        assert ok == expected
        if not ok:
            assert snapshot(self.bm) == before
            self.counts["failed"] += 1
            victim = max(self.running)  # recompute-preempt the newest
            self.preempt(victim)
            return
        table = self.bm.block_table(seq_id)
        assert table[: len(old_table)] == old_table
        for block in table[len(old_table) :]:
            for slot in range(block * BS, (block + 1) * BS):
                self.shadow[slot] = None  # fresh block: garbage until written
        for pos in range(computed, target):
            self.shadow[self.bm.slot(seq_id, pos)] = tokens[pos]
        self.running[seq_id][1] = target
        if target == len(tokens) and len(tokens) >= 40:
            self.finish(seq_id)

    def finish(self, seq_id: int | None = None) -> None:
        if self.running:
            seq_id = self.rng.choice(list(self.running)) if seq_id is None else seq_id
            self.bm.free(seq_id)
            del self.running[seq_id]
            self.counts["finished"] += 1

    def preempt(self, seq_id: int | None = None) -> None:
        if self.running:
            seq_id = self.rng.choice(list(self.running)) if seq_id is None else seq_id
            self.bm.free(seq_id)
            self.waiting[seq_id] = self.running.pop(seq_id)[0]

    def fork(self) -> None:
        candidates = [s for s, (_, c) in self.running.items() if c >= 1]
        if not candidates or len(self.running) >= 8:
            return
        parent = self.rng.choice(candidates)
        tokens, computed = self.running[parent]
        child = self.new_id()
        shared = self.bm.fork(parent, child, computed)
        assert shared == (computed - 1) // BS * BS
        assert self.bm.block_table(child) == self.bm.block_table(parent)[: shared // BS]
        self.running[child] = [list(tokens[:computed]), shared]
        self.counts["forks"] += 1

    def reset(self) -> None:
        self.bm.reset_prefix_cache()

    def check_invariants(self) -> None:
        bm = self.bm
        tables = {s: bm.block_table(s) for s in self.running}
        holders: dict[int, list[tuple[int, int]]] = {}
        for seq_id, table in tables.items():
            tokens, computed = self.running[seq_id]
            assert len(table) * BS >= computed
            assert len(set(table)) == len(table)
            for index, block in enumerate(table):
                holders.setdefault(block, []).append((seq_id, index))
            # Nobody overwrote this sequence's KV.
            for pos in range(computed):
                assert self.shadow[bm.slot(seq_id, pos)] == tokens[pos]
        for block in range(self.num_blocks):
            assert bm.ref_count(block) == len(holders.get(block, [])) >= 0
        for block, users in holders.items():
            if len(users) > 1:  # only a full prefix block, at the same index, may be shared
                assert len({index for _, index in users}) == 1
                for seq_id, index in users:
                    assert (index + 1) * BS <= self.running[seq_id][1]
        assert bm.num_free_blocks == self.num_blocks - len(holders)
        for seq_id in self.waiting:
            with pytest.raises(ValueError):
                bm.block_table(seq_id)

    def run(self, num_ops: int) -> None:
        ops = [self.add, self.schedule, self.step, self.finish, self.preempt, self.fork, self.reset]
        weights = [10, 15, 55, 4, 5, 5, 0.3]
        for _ in range(num_ops):
            self.rng.choices(ops, weights)[0]()
            self.check_invariants()
        for seq_id in list(self.running):
            self.finish(seq_id)
            self.check_invariants()
        assert self.bm.num_free_blocks == self.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.num_blocks))


@pytest.mark.parametrize("enable", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_trace(seed, enable):
    trace = Trace(seed, enable)
    trace.run(2500)
    counts = trace.counts
    # The trace exercised what it is meant to.
    assert counts["failed"] > 0 and counts["forks"] > 0 and counts["finished"] > 0
    assert (counts["hits"] > 0) == enable
    assert trace.bm.stats.hits == counts["hits"]
    if enable:
        assert trace.bm.stats.evictions > 0
