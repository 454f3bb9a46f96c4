"""The backend protocol and the request-side description of a constraint."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass
from importlib import resources
from typing import Literal, Protocol

import numpy as np
import torch

from asyncpage.errors import GrammarError
from asyncpage.guided.style import closed_objects, spelled
from asyncpage.params import SamplingParams
from asyncpage.runtime.reduce import first_max

Kind = Literal["json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GuidedSpec:
    kind: Kind
    value: str  # canonical text: JSON for schemas and choice lists, the regex, or the grammar text

    @staticmethod
    def from_params(p: SamplingParams) -> GuidedSpec | None:
        if p.json_schema is not None:
            # `true` and `false` are JSON Schemas too: any JSON value, and none (which no output meets).
            if p.json_schema is False:
                raise GrammarError("json_schema", "false matches nothing: no output can satisfy it")
            schema = {} if p.json_schema is True else p.json_schema
            try:
                # No undeclared properties unless asked for (p.json_closed_objects), and JSON spelled with
                # the request's separators, named in the root's x-guidance for both backends (style.py).
                if p.json_closed_objects:
                    schema = closed_objects(schema)
                schema = spelled(schema, p.json_separators)
                # Key order is kept: properties are generated in the order the schema lists them.
                return GuidedSpec("json_schema", json.dumps(schema, allow_nan=False))
            except (TypeError, ValueError, RecursionError) as exc:
                raise GrammarError("json_schema", f"not a JSON document: {exc}") from None
        if p.regex is not None:
            return GuidedSpec("regex", p.regex)
        if p.choice is not None:
            return GuidedSpec("choice", json.dumps(list(p.choice)))
        if p.grammar is not None:
            return GuidedSpec("grammar", shipped_grammar(p.grammar) or p.grammar)
        return None


def shipped_grammar(name: str) -> str | None:
    """The text of a grammar shipped in asyncpage.grammars (`json`, `arithmetic`, `sql_select`), or
    None when `name` is not one (then it is grammar text itself)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return None
    res = resources.files("asyncpage.grammars").joinpath(f"{name}.lark")
    return res.read_text() if res.is_file() else None


def shipped_grammar_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("asyncpage.grammars").iterdir() if p.name.endswith(".lark"))


class Deadline:
    """A compile's time bound, checked cooperatively by the Python parts of compilation (schema
    rewrites, candidate validation): a hostile schema stops costing CPU when its time is up, instead
    of running on in an abandoned thread. llguidance's own work is bounded by its fuel limits."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise CompileTimeout(f"compiling took longer than {self.seconds:g} s")


class CompileTimeout(Exception):
    """Raised inside a compile whose Deadline has passed (turned into a GrammarError by the backend)."""


NO_DEADLINE = Deadline(float("inf"))


class Matcher(Protocol):
    """Per-sequence grammar state. Touched only by the worker thread during a step."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def accept(self, token: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would take from here (nothing is consumed)."""
        ...

    def is_accepting(self) -> bool: ...

    def is_terminated(self) -> bool: ...

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows and no alternative to, from here (not consumed). [] if unknown."""
        ...

    def fork(self) -> Matcher: ...


class CompiledGrammar(Protocol):
    def new_matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: GuidedSpec, deadline: Deadline = NO_DEADLINE) -> CompiledGrammar:
        """Compile or raise GrammarError naming the field (and the unsupported keyword if any); past
        `deadline`, GrammarError as well."""
        ...


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [N, V] float; bitmask [N, ceil(V/32)] int32 (bit j of word i allows token 32*i + j).
    Sized to the logits width, never to len(tokenizer): the two differ for some checkpoints; a mask
    narrower than the logits is refused (ValueError).
    Every disallowed token becomes -inf. float32 CPU logits go through numpy (165 against 729 us for a
    262k row on the AMD VM, `python scripts/sampling_bench.py`): the bits unpacked to +inf (allowed) or
    -inf and fmin'ed into the row, so an allowed NaN logit becomes +inf, where the masked_fill path leaves
    it NaN: either way not finite, and the row has no valid token (sampling.py)."""
    n, v = logits.shape
    if 32 * bitmask.shape[-1] < v or bitmask.shape[0] != n:
        raise ValueError(f"a guided-decoding mask of shape {tuple(bitmask.shape)} does not cover logits of "
                         f"shape {(n, v)}")
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and bitmask.device.type == "cpu" and bitmask.dtype == torch.int32 and bitmask.is_contiguous()
            and sys.byteorder == "little"):
        a = logits.numpy()
        inf = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little", count=v).astype(np.float32)
        inf -= 0.5
        with np.errstate(divide="ignore"):
            np.divide(inf, 0, out=inf)  # -0.5 / 0 = -inf (disallowed), 0.5 / 0 = +inf (allowed)
        np.fmin(a, inf, out=a)  # fmin: a disallowed NaN gives -inf too
        return
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).reshape(n, -1)[:, :v].bool()
    logits.masked_fill_(~allowed, float("-inf"))


# Up to this many allowed tokens, a greedy or beam row is decided over those tokens' values alone
# (allowed_tokens), not by masking the whole row: a JSON grammar between values, a copied span or a closed
# choice allows a handful of a 262k vocabulary.
FEW_ALLOWED = 4096


def allowed_tokens(bitmask_row: torch.Tensor, vocab: int, limit: int = FEW_ALLOWED) -> torch.Tensor | None:
    """The token ids (ascending, int64) below `vocab` that `bitmask_row` allows, when there are at most
    `limit` of them; None when more (mask the row instead). A mask narrower than `vocab` is refused
    (ValueError), as apply_bitmask refuses it."""
    if 32 * bitmask_row.shape[-1] < vocab:
        raise ValueError(f"a guided-decoding mask of {bitmask_row.shape[-1]} words does not cover {vocab} tokens")
    if bitmask_row.device.type != "cpu" or bitmask_row.dtype != torch.int32 or sys.byteorder != "little":
        return None
    words = bitmask_row.contiguous().numpy()
    nz = np.flatnonzero(words)  # the words with an allowed token: one scan of 32x fewer values than tokens
    if nz.size > limit:
        return None
    bits = np.unpackbits(words[nz].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little").view(np.bool_)
    ids = (nz[:, None] * 32 + np.arange(32))[bits]  # ascending: words in order, bits in order within each
    ids = ids[ids < vocab]
    return torch.from_numpy(ids.astype(np.int64)) if ids.size <= limit else None


def keeps_maximum(row: torch.Tensor, bitmask_row: torch.Tensor, top: tuple[float, int] | None = None) -> int | None:
    """The token a greedy pick takes from `row` (one row of logits) under `bitmask_row`, when the mask
    need not be applied to know it: the row's first maximal token if it is finite and the grammar allows
    it (masking only removes tokens, so it stays the first maximal one); None otherwise (mask the row).
    A 262k row costs ~35 us to search and ~0.17 ms to mask (scripts/sampling_bench.py). `top`: the row's
    maximum and its first index when the caller has found them already (sample() and a speculative
    verify find every row's at once)."""
    if 32 * bitmask_row.shape[0] < row.shape[-1]:
        return None  # a mask narrower than the row: apply_bitmask refuses it, loudly
    if top is None:
        value, token = first_max(row)
        top = float(value), int(token)
    value_f, t = top
    if not math.isfinite(value_f):
        return None
    return t if (int(bitmask_row[t >> 5]) >> (t & 31)) & 1 else None


def choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def grammar_error(spec: GuidedSpec, message: str) -> GrammarError:
    m = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if m:
        keys = m.group(1).replace('"', "")
        return GrammarError(spec.kind, f"unsupported JSON Schema keyword(s) {keys}: {message}")
    return GrammarError(spec.kind, message)
