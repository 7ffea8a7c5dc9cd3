"""The KV-cache block allocator: reference counts, per-sequence block tables, prefix sharing, copy-on-write.

Follows vLLM's PagedAttention (SOSP 2023): the cache is cut into blocks of ``block_size`` token slots and each
sequence owns a table of block ids, like pages of virtual memory. Blocks are shared by reference counting:

- Prefix caching: once a block is full its K/V are immutable and it is keyed by a hash of all tokens up to its end
  (a chain: key_i = H(key_{i-1}, tokens of block i)). A new sequence whose prompt starts with the same tokens takes
  those blocks instead of recomputing them. Freed blocks keep their key and stay findable until they are reused,
  least recently freed first.
- Parallel sampling (n > 1): the completions of one prompt share every block, including the partly filled last
  one; the first completion that writes into a shared block gets a private copy (copy-on-write), and the caller
  copies the block's contents on the device.

The KV-waste figure is the allocated slots (blocks with a reference x block size) minus the slots holding K/V.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from quantkit.runtime.sequence import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.filled = [0] * num_blocks  # slots of each block holding K/V
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # prefix key -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # ref 0, oldest first
        self.used_slots = 0  # sum of `filled` over blocks with a reference

    @property
    def num_free(self) -> int:
        return len(self.free)

    # -- prefix keys ---------------------------------------------------------------------------------------------

    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Prefix keys of the first ``num_blocks`` full blocks of ``seq`` (memoised on the sequence)."""
        bs = self.block_size
        while len(seq.block_keys) < num_blocks:
            i = len(seq.block_keys)
            h = hashlib.blake2b(seq.block_keys[-1] if i else b"", digest_size=16)
            h.update(np.asarray(seq.token_ids[i * bs : (i + 1) * bs], dtype=np.int64).tobytes())
            seq.block_keys.append(h.digest())
        return seq.block_keys[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``; never the block of its last token, which must be
        computed to give the logits."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in self._keys(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- capacity ------------------------------------------------------------------------------------------------

    def _needs_copy(self, seq: Sequence) -> bool:
        """Whether the next write of ``seq`` lands in a partly filled block that another sequence shares."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and self.ref_counts[seq.block_table[i]] > 1

    def appendable_tokens(self, seq: Sequence) -> int:
        """How many more tokens ``seq`` could write now (its spare slots plus all free blocks)."""
        blocks = len(seq.block_table) + self.num_free - int(self._needs_copy(seq))
        return max(0, blocks * self.block_size - seq.num_computed_tokens)

    def can_admit(self, seq: Sequence, hits: list[int], num_new: int) -> bool:
        """Whether a waiting ``seq`` can take ``hits`` and room for ``num_new`` more tokens."""
        fresh = _cdiv(len(hits) * self.block_size + num_new, self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # cached blocks sitting on the free list
        return fresh + revived <= self.num_free

    # -- changes ---------------------------------------------------------------------------------------------------

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
            self.used_slots += self.filled[block]
        self.ref_counts[block] += 1

    def _new_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:  # evict it from the prefix cache
            if self.cached.get(key) == block:
                del self.cached[key]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        self.filled[block] = 0
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.used_slots -= self.filled[block]
            self.free[block] = None

    def admit(self, seq: Sequence, hits: list[int], num_new: int) -> None:
        """Give a waiting ``seq`` its cached prefix and room for ``num_new`` tokens (``can_admit`` was checked)."""
        assert not seq.block_table, f"{seq} already holds blocks"
        for block in hits:
            self._take(block)
        seq.block_table = list(hits)
        seq.table_version += 1
        seq.num_computed_tokens = len(hits) * self.block_size
        self.append(seq, num_new)

    def append(self, seq: Sequence, num_new: int) -> list[tuple[int, int]]:
        """Make room for ``num_new`` tokens after the computed ones; returns the (src, dst) block copies the device
        must do first (copy-on-write). The caller checked ``appendable_tokens``."""
        copies = []
        if self._needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src = seq.block_table[i]
            dst = self._new_block()
            self.filled[dst] = self.filled[src]
            self.used_slots += self.filled[dst]
            self._release(src)
            seq.block_table[i] = dst
            seq.table_version += 1
            copies.append((src, dst))
        while len(seq.block_table) * self.block_size < seq.num_computed_tokens + num_new:
            seq.block_table.append(self._new_block())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block in parent.block_table:
            self._take(block)
        child.block_table = list(parent.block_table)
        child.table_version += 1

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first (so its tail is evicted from the prefix cache first)."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.table_version += 1
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's computed tokens: the slots of rejected drafted tokens. Those
        blocks were appended for this step alone (private, never keyed), so nothing shared is touched."""
        keep = _cdiv(seq.num_computed_tokens, self.block_size)
        if len(seq.block_table) > keep:
            for block in reversed(seq.block_table[keep:]):
                self._release(block)
            del seq.block_table[keep:]
            seq.table_version += 1

    def commit(self, seq: Sequence, start: int) -> None:
        """Record K/V written at positions ``start .. num_computed_tokens - 1``: fill counts, and prefix keys of
        the blocks that became full."""
        bs, end = self.block_size, seq.num_computed_tokens
        for i in range(start // bs, _cdiv(end, bs)):
            block = seq.block_table[i]
            fill = min(bs, end - i * bs)
            self.used_slots += fill - self.filled[block]
            self.filled[block] = fill
        if not self.enable_prefix_caching or end // bs <= start // bs:
            return
        for i, key in enumerate(self._keys(seq, end // bs)[start // bs :], start // bs):
            block = seq.block_table[i]
            if self.block_keys[block] is None and key not in self.cached:
                self.block_keys[block] = key
                self.cached[key] = block

    def kv_usage(self) -> tuple[int, int]:
        """(allocated slots, slots holding K/V) over blocks with a reference."""
        return (self.num_blocks - self.num_free) * self.block_size, self.used_slots
