"""One physical block of the KV pool, as the bookkeeping sees it: an id, a reference count, and once
full the digest and tokens of the prefix it holds. Integers only: the tensors are the runner's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and its content is known: the chained digest (parent digest +
    # token ids + salt) and the tokens themselves, compared on a hit so a digest collision can never
    # hand out another prefix's KV.
    digest: bytes | None = None
    tokens: tuple[int, ...] | None = None
