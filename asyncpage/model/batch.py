"""A step's input to a model's forward: the tokens of many sequences back to back, their KV slots and
the attention metadata (model/attention.py) built from the block tables. Owns no KV storage and no
scheduling; the runner (core/runner.py), the draft model (core/draft.py) and compiled decode's warm-up
(model/compiled.py) fill it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from asyncpage.model.attention import AttentionMetadata, PrefillChunk

EXACT_ROWS = 8  # steps of up to this many tokens are never padded (the fused and compiled decode steps' rows)


class FlatBatch:
    """A step's tokens from many sequences back to back (no padding between them), with the slots
    their K/V go to and what attention needs: a sequence's run of one token is a decode row, a
    longer run a prefill chunk over its cached context. Shared by the model runner and the draft
    model (core/draft.py), and by compiled decode's warm-up (model/compiled.py)."""

    def __init__(self, block_size: int, pad_slot: int, device: torch.device,
                 attention: Callable[..., torch.Tensor], exact_rows: int = EXACT_ROWS) -> None:
        """`exact_rows`: steps of up to this many tokens are not padded (see build)."""
        self.block_size, self.pad_slot, self.device, self.attention = block_size, pad_slot, device, attention
        self.exact_rows = max(exact_rows, EXACT_ROWS)
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.decode_rows: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.prefills: list[PrefillChunk] = []

    def add(self, tokens: list[int], num_computed: int, table: list[int], rows: bool = False) -> int:
        """Append a sequence's `tokens`, at positions from `num_computed` on; returns its first row.
        `rows`: each token a decode row of its own (its context up to itself), not one prefill chunk:
        a speculative verify in a step the fused decode step takes (core/runner.py), so that each row
        is computed as a one-token decode step computes it, whatever the rows beside it, and greedy
        speculation gives the tokens decoding without it gives. Every attention backend writes all the
        step's K/V before any row attends."""
        bs, start, n = self.block_size, len(self.input_ids), len(tokens)
        self.input_ids += tokens
        self.positions += range(num_computed, num_computed + n)
        self.slots += [table[p // bs] * bs + p % bs for p in range(num_computed, num_computed + n)]
        if n == 1 or rows:
            self.decode_rows += range(start, start + n)
            self.decode_tables += [table] * n
            self.decode_lens += range(num_computed + 1, num_computed + n + 1)
        else:
            self.prefills.append(PrefillChunk(start, start + n, num_computed, self._t(table)))
        return start

    def build(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata). The batch is padded to a few bucket sizes: the
        CPU matmul libraries build a kernel per new shape (~0.5 ms per matmul), which cost a cold
        engine 30% of its throughput when every step had a new token count. A model whose projections
        are all block kernels up to some row count (gguf_linear.unpadded_rows: no per-shape kernel, a
        cost linear in the rows) is not padded up to it. Padding rows attend to nothing and write their
        K/V to the pad slot."""
        pad = _bucket(len(self.input_ids), self.exact_rows) - len(self.input_ids)
        meta = AttentionMetadata(block_size=self.block_size, slot_mapping=self._t(self.slots + [self.pad_slot] * pad),
                                 prefills=self.prefills, attention=self.attention)
        if self.decode_rows:
            width = max(len(t) for t in self.decode_tables)
            meta.decode_rows = self._t(self.decode_rows)
            meta.decode_block_tables = self._t([t + [0] * (width - len(t)) for t in self.decode_tables])
            meta.decode_context_lens = self._t(self.decode_lens)
            meta.decode_tables_host, meta.decode_lens_host = self.decode_tables, self.decode_lens
        return self._t(self.input_ids + [0] * pad), self._t(self.positions + [0] * pad), meta

    def _t(self, xs: list[int] | list[list[int]]) -> torch.Tensor:
        return long_tensor(xs, self.device)


def long_tensor(xs: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 tensor of `xs` on `device`. On the CPU through numpy: torch.tensor parses a list item by item
    (3.5 us for one element against 1.0; a decode step makes eight of these, each several times slower once
    the forward has pushed this code out of the caches)."""
    if device.type != "cpu":
        return torch.tensor(xs, dtype=torch.long, device=device)
    return torch.from_numpy(np.array(xs, dtype=np.int64))


def consecutive(rows: list[int]) -> tuple[int, int] | None:
    """(first, end) when `rows` are first, first + 1, ..., end - 1 (a slice of them is a view, no gather); else
    None."""
    return (rows[0], rows[-1] + 1) if rows and rows == list(range(rows[0], rows[-1] + 1)) else None


def _bucket(n: int, exact: int = EXACT_ROWS) -> int:
    """1..`exact` exactly (one stream must not pay for padding), then multiples of 8 up to 64, then of 64."""
    if n <= exact:
        return n
    if n <= 64:
        return -(-n // 8) * 8
    return -(-n // 64) * 64
