"""Prefix caching: the KV of earlier requests' token blocks, kept in a bounded pool and copied
into a new request's cache row when its prompt starts with them (a system prompt, a shared
document, the conversation so far), so only the rest of the prompt is prefilled.

    pool = PrefixCache(max_bytes=256 << 20)
    engine = BatchEngine(runner, max_batch=8, prefix_cache=pool)   # runtime/batching.py

Blocks. A prompt is cut into blocks of BLOCK tokens; block i's key is a digest of block i-1's key
and block i's tokens, so a key names the whole prefix up to the block's end and equal keys
mean equal prefixes. A block holds that prefix's last BLOCK positions of K and V for every
layer, as the step graph wrote them.

When. A request's prompt blocks go in when its prefill ends (the KV is in its row then), and the
blocks of its prompt and answer when it finishes (what a next turn of the chat starts with). A
request looks its prompt up once, as its prefill begins: the longest run of blocks from the
start that the pool holds is copied into its row, and prefill goes on after it. At least one
prompt token is always prefilled: its logits give the first token.

Bound. The pool's arrays never exceed `max_bytes`: before a block goes in, the least recently
used blocks that no other block continues are evicted (a block's children would be unreachable
without it), and a block that cannot fit is not kept. The hit rate (prompt tokens served from
the pool / prompt tokens looked up) and the evictions are counted for /metrics.

Exactness. A hit gives the row the KV an earlier prefill computed for the same tokens at the same
positions. It may have been computed in other chunks than this prompt's own prefill would use
(a prefill running beside decoding rows goes in 64-token chunks); with the step floor
(runtime/session.py) every chunk size gives the same bits on an engine whose build measured it
bitwise, so a hit's answer is the answer without the pool; otherwise the arithmetic moves within
the engine's measured bound, as continuous batching's does (runtime/batching.py). Drafts that
read the target's features (EAGLE, MTP, Medusa heads) need every prompt position's features,
which the pool does not keep: their engines prefill every prompt (BatchEngine does not look up).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

BLOCK = 32  # tokens per block


@dataclasses.dataclass
class _Block:
    keys: object  # (L, Hkv, BLOCK, D) of the cache's dtype (numpy, or torch on a device)
    values: object
    parent: bytes | None
    children: int = 0

    @property
    def nbytes(self) -> int:
        return 2 * int(self.keys.nbytes)


def _copy(x):
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


class PrefixCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()  # least recently used first
        self.bytes = 0
        self.looked_up = 0  # prompt tokens looked up
        self.hit = 0  # of which served from the pool
        self.evicted = 0  # blocks

    @property
    def hit_rate(self) -> float:
        return self.hit / self.looked_up if self.looked_up else 0.0

    @staticmethod
    def keys(tokens, blocks: int) -> list[bytes]:
        """The keys of the first `blocks` blocks of `tokens`."""
        out, parent = [], b""
        for i in range(blocks):
            chunk = np.asarray(tokens[i * BLOCK : (i + 1) * BLOCK], dtype=np.int64).tobytes()
            parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
            out.append(parent)
        return out

    def lookup(self, prompt, cache, row: int) -> int:
        """Copy the longest cached run of `prompt`'s blocks into `row` of `cache` (from position
        0); returns how many tokens it covers (a multiple of BLOCK, less than the prompt)."""
        self.looked_up += len(prompt)
        if not self.blocks:
            return 0
        found = []
        for key in self.keys(prompt, (len(prompt) - 1) // BLOCK):
            block = self.blocks.get(key)
            if block is None:
                break
            found.append((key, block))
        for i, (key, block) in enumerate(found):
            cache.keys[:, row, :, i * BLOCK : (i + 1) * BLOCK] = block.keys
            cache.values[:, row, :, i * BLOCK : (i + 1) * BLOCK] = block.values
            self.blocks.move_to_end(key)
        covered = len(found) * BLOCK
        cache.lengths[row] = covered
        self.hit += covered
        return covered

    def insert(self, tokens, cache, row: int) -> None:
        """Keep the blocks of `tokens` whose KV is in `row` of `cache` (its first
        cache.lengths[row] positions); blocks already kept are only marked used."""
        blocks = min(len(tokens), int(cache.lengths[row])) // BLOCK
        parent = None
        for i, key in enumerate(self.keys(tokens, blocks)):
            if key in self.blocks:
                self.blocks.move_to_end(key)
            else:
                span = slice(i * BLOCK, (i + 1) * BLOCK)
                block = _Block(_copy(cache.keys[:, row, :, span]), _copy(cache.values[:, row, :, span]), parent)
                if not self._make_room(block.nbytes, keep=parent):
                    return
                self.blocks[key] = block
                self.bytes += block.nbytes
                if parent is not None:
                    self.blocks[parent].children += 1
            parent = key

    def _make_room(self, nbytes: int, keep: bytes | None) -> bool:
        """Evict least recently used leaves until `nbytes` more fit (never `keep`, the block the
        new one continues); False when they cannot."""
        while self.bytes + nbytes > self.max_bytes:
            leaf = next((k for k, b in self.blocks.items() if b.children == 0 and k != keep), None)
            if leaf is None:
                return False
            block = self.blocks.pop(leaf)
            self.bytes -= block.nbytes
            self.evicted += 1
            if block.parent is not None and block.parent in self.blocks:
                self.blocks[block.parent].children -= 1
        return True
