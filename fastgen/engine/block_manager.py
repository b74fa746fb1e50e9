"""KV-cache block manager: fixed-size blocks, reference counts and prefix caching.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots; slot index
``block_id * block_size + offset``. Each sequence (an int ``seq_id``) owns a block table. Full blocks
are registered in a prefix cache under a chained key, so a later sequence with the same prefix
reuses them instead of recomputing their KV.

Chained keys are ``(parent_node, tuple(block tokens))`` where ``parent_node`` is a unique, never
reused integer given to the registered previous block (``-1 - namespace`` for the first block: KV
computed differently for the same tokens, such as LongRoPE's long factors, lives in its own
namespace and never matches the other). Because node
ids are never reused, a node id stands for exactly one token prefix, so a key names its whole prefix
exactly; the dict compares keys by value, so a hash collision can never produce a wrong hit, and
keys stay small (no nested tuples re-hashed on every lookup).

A block is in exactly one of three states: referenced (ref count > 0), cached (ref count 0 but
still registered: findable, evictable in LRU order) or free (ref count 0, unregistered).

A hybrid model (linear-attention layers beside attention) also keeps a fixed-size recurrent state per
sequence: with ``num_state_slots`` the manager hands each sequence one state slot with its first
blocks and takes it back when it frees them, so a slot is one more resource a step can run out of,
with the same answer (wait, or preempt). Such a state exists only after a sequence's last computed
token, never at a block boundary, so there is nothing for a prefix-cache hit or a forked choice to
resume from: prefix caching is refused and ``fork`` shares no blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_ROOT = -1  # parent node of a sequence's first block in namespace 0 (namespace n: -1 - n)
_Key = tuple[int, tuple[int, ...]]


def _root(namespace: int) -> int:
    """Parent node of a first block in ``namespace``."""
    _check_int("namespace", namespace, 0)
    return _ROOT - namespace


def _check_int(name: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters (``reset_prefix_cache`` does not clear them)."""

    requests: int = 0
    """Number of ``match_prefix`` calls made with prefix caching enabled."""
    queries: int = 0
    """Tokens looked up: the sum of ``len(token_ids)`` over those calls."""
    hits: int = 0
    """Tokens found in the cache: the sum of ``match_prefix`` results."""
    evictions: int = 0
    """Cached blocks whose entry was dropped so that their memory could be reused."""

    @property
    def hit_rate(self) -> float:
        """``hits / queries``, 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class _SeqBlocks:
    """Per-sequence state."""

    blocks: list[int] = field(default_factory=list)
    """The block table."""
    nodes: list[int] = field(default_factory=list)
    """Cache node of each full block registered so far (the chain's parents); caching only."""
    num_tokens: int = 0
    """Token slots covered with KV (or about to be, after the current step)."""
    root: int = _ROOT
    """Parent node of the first block: the sequence's prefix-cache namespace."""
    state_slot: int = -1
    """The sequence's recurrent-state slot (-1: none yet, or the model keeps no state)."""


class BlockManager:
    """Host-side allocator of KV-cache blocks with reference counts and prefix caching.

    Allocation takes truly free blocks first (the most recently freed first), then evicts cached
    unreferenced blocks, least recently freed or matched first. Blocks of a freed sequence enter the
    LRU order tail first, so the shared heads of prefixes outlive their tails.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0) -> None:
        """Create a manager over ``num_blocks`` blocks of ``block_size`` slots, all free, and
        ``num_state_slots`` recurrent-state slots (0: the model keeps no state)."""
        self.num_blocks = _check_int("num_blocks", num_blocks, 1)
        self.block_size = _check_int("block_size", block_size, 1)
        self.num_state_slots = _check_int("num_state_slots", num_state_slots, 0)
        if num_state_slots and enable_prefix_caching:
            raise ValueError("prefix caching cannot serve a model with recurrent-state slots: a cached block holds "
                             "no recurrent state to resume from")
        self._free_state_slots: deque[int] = deque(range(num_state_slots - 1, -1, -1))
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.stats = PrefixCacheStats()
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[_Key | None] = [None] * num_blocks
        self._block_nodes = [_ROOT] * num_blocks
        # A stack, block 0 on top: the most recently freed block is reused first. Its KV memory is
        # warm; a FIFO would walk through every never-used block first, faulting in the whole
        # (lazily allocated) CPU cache, which grows a server's RSS request after request.
        self._free: deque[int] = deque(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref count 0, LRU first
        self._cache: dict[_Key, int] = {}
        self._seqs: dict[int, _SeqBlocks] = {}
        self._next_node = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: truly free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free_state_slots(self) -> int:
        """Recurrent-state slots not held by any sequence."""
        return len(self._free_state_slots)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cache)

    def blocks_needed(self, num_tokens: int) -> int:
        """Number of blocks that hold ``num_tokens`` token slots."""
        _check_int("num_tokens", num_tokens, 0)
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq_id: int, token_ids: Sequence[int], namespace: int = 0) -> int:
        """Start the block table of a new (or resumed) sequence with its longest cached prefix in
        ``namespace``.

        Takes a reference on every matched full block and returns how many tokens already have
        their KV: a multiple of ``block_size``, at most ``len(token_ids) - 1`` so that one token is
        left to compute for logits. If the following ``allocate`` fails and the sequence goes back
        to waiting, call ``free(seq_id)`` to drop these references.
        """
        _check_int("seq_id", seq_id)
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id} already has blocks; free() it before match_prefix")
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        seq = self._seqs[seq_id] = _SeqBlocks(root=_root(namespace))
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        parent = seq.root
        for i in range((len(token_ids) - 1) // bs):
            block = self._cache.get((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            if block is None:
                break
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            parent = self._block_nodes[block]
            seq.blocks.append(block)
            seq.nodes.append(parent)
        seq.num_tokens = len(seq.blocks) * bs
        self.stats.requests += 1
        self.stats.queries += len(token_ids)
        self.stats.hits += seq.num_tokens
        return seq.num_tokens

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Whether ``allocate(seq_id, ..., num_tokens)`` would succeed now."""
        seq = self._seqs.get(seq_id)
        have = len(seq.blocks) if seq is not None else 0
        if self.num_state_slots and (seq is None or seq.state_slot < 0) and not self._free_state_slots:
            return False
        return self.blocks_needed(num_tokens) - have <= self.num_free_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_tokens: int, namespace: int = 0,
                 num_lookahead: int = 0) -> bool:
        """Grow the block table of ``seq_id`` to cover ``num_tokens + num_lookahead`` slots.

        ``token_ids[:num_tokens]`` are the tokens whose KV exists after this step; every block they
        fill is registered in the prefix cache, in ``namespace`` (which must be the table's). The
        ``num_lookahead`` slots after them hold KV that may be thrown away (speculative decoding's
        draft tokens): never registered, and rewritten by a later step if rejected. Returns False,
        changing nothing, when not enough blocks can be had. A sequence unknown so far gets an empty
        table first; a coverage below the current one is a no-op.
        """
        _check_int("seq_id", seq_id)
        _check_int("num_tokens", num_tokens, 0)
        _check_int("num_lookahead", num_lookahead, 0)
        if num_tokens > len(token_ids):
            raise ValueError(f"num_tokens {num_tokens} exceeds len(token_ids) {len(token_ids)}")
        known = self._seqs.get(seq_id)
        if known is not None and known.root != _root(namespace):
            raise ValueError(f"seq_id {seq_id} has its blocks in namespace {self.namespace(seq_id)}, not {namespace}")
        if not self.can_allocate(seq_id, num_tokens + num_lookahead):
            return False
        seq = self._seqs.setdefault(seq_id, _SeqBlocks(root=_root(namespace)))
        if self.num_state_slots and seq.state_slot < 0:
            seq.state_slot = self._free_state_slots.pop()
        for _ in range(self.blocks_needed(num_tokens + num_lookahead) - len(seq.blocks)):
            seq.blocks.append(self._take_block())
        seq.num_tokens = max(seq.num_tokens, num_tokens)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, token_ids, num_tokens)
        return True

    def namespace(self, seq_id: int) -> int | None:
        """The prefix-cache namespace of ``seq_id``'s blocks (None: it has no block table)."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else _ROOT - seq.root

    def state_slot(self, seq_id: int) -> int:
        """The recurrent-state slot of ``seq_id`` (-1 when the model keeps no state)."""
        return self._get(seq_id).state_slot

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the block table of ``seq_id``."""
        return list(self._get(seq_id).blocks)

    def slot(self, seq_id: int, position: int) -> int:
        """Slot index (``block_id * block_size + offset``) of token ``position`` of ``seq_id``."""
        blocks = self._get(seq_id).blocks
        _check_int("position", position, 0)
        if position >= len(blocks) * self.block_size:
            raise ValueError(
                f"position {position} is beyond the {len(blocks) * self.block_size} slots "
                f"allocated to seq_id {seq_id}"
            )
        block, offset = divmod(position, self.block_size)
        return blocks[block] * self.block_size + offset

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> int:
        """Give ``child_id`` the parent's full blocks covering ``token_ids[:num_tokens]``.

        The partially filled last block is never shared (both sequences would write into it).
        Returns the number of shared tokens: a multiple of ``block_size``, at most
        ``num_tokens - 1``; 0 with state slots (the child computes its own state from the start).
        """
        parent = self._get(parent_id)
        _check_int("child_id", child_id)
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id} already has blocks")
        _check_int("num_tokens", num_tokens, 1)
        if num_tokens > parent.num_tokens:
            raise ValueError(
                f"num_tokens {num_tokens} exceeds the {parent.num_tokens} tokens allocated "
                f"to parent_id {parent_id}"
            )
        shared = 0 if self.num_state_slots else (num_tokens - 1) // self.block_size
        child = _SeqBlocks(parent.blocks[:shared], parent.nodes[:shared], shared * self.block_size, parent.root)
        for block in child.blocks:
            self._ref_counts[block] += 1  # already referenced by the parent, so never evictable
        self._seqs[child_id] = child
        return child.num_tokens

    def free(self, seq_id: int) -> None:
        """Drop the references of a finished, aborted or preempted sequence (unknown: no-op)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if seq.state_slot >= 0:
            self._free_state_slots.append(seq.state_slot)
        # Tail first, so that eviction takes a prefix's tail before its (more shareable) head.
        for block in reversed(seq.blocks):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            if self._block_keys[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use stay valid and are freed normally later."""
        self._cache.clear()
        self._block_keys = [None] * self.num_blocks
        self._block_nodes = [_ROOT] * self.num_blocks
        self._free.extend(self._evictable)
        self._evictable.clear()

    def ref_count(self, block_id: int) -> int:
        """Number of block tables holding ``block_id``."""
        _check_int("block_id", block_id, 0)
        if block_id >= self.num_blocks:
            raise ValueError(f"block_id {block_id} out of range [0, {self.num_blocks})")
        return self._ref_counts[block_id]

    def _get(self, seq_id: int) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown seq_id {seq_id}: it has no blocks")
        return seq

    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cache[self._block_keys[block]]
            self._block_keys[block] = None
            self._block_nodes[block] = _ROOT
            self.stats.evictions += 1
        self._ref_counts[block] = 1
        return block

    def _register_full_blocks(
        self, seq: _SeqBlocks, token_ids: Sequence[int], num_tokens: int
    ) -> None:
        bs = self.block_size
        parent = seq.nodes[-1] if seq.nodes else seq.root
        for i in range(len(seq.nodes), num_tokens // bs):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            existing = self._cache.get(key)
            if existing is None:
                block = seq.blocks[i]
                parent = self._next_node
                self._next_node += 1
                self._cache[key] = block
                self._block_keys[block] = key
                self._block_nodes[block] = parent
            else:
                # Same prefix written concurrently by another sequence: keep our own block
                # (unregistered, freed straight to the free list) and chain on the cached node.
                parent = self._block_nodes[existing]
            seq.nodes.append(parent)
