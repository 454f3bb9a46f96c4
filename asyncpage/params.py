"""SamplingParams: what a caller may ask of one request, checked at construction.

Checks that need the model (vocabulary size, context length, pool size) happen at submission in
`engine.py`; everything that can be checked from the values alone is checked here, so a bad value
fails where it was written, with the field's name.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from asyncpage.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
# Stop strings are matched on the engine loop after every token (asyncpage.decoding.detokenizer): their work per
# token grows with count x length, so both are bounded (OpenAI takes 4; vLLM no bound at all).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
# Past float32's range the sampler's division turns a masked row into NaN; no use needs more.
MAX_TEMPERATURE = 1e4

# json.dumps' spelling: what models read most (a chat template's `tojson` writes it too). Compact JSON
# (`{"age":31}`) led the default model to `100000000000000` where it wrote 31 with these.
DEFAULT_SEPARATORS = (", ", ": ")
COMPACT_SEPARATORS = (",", ":")
MAX_SEPARATOR_CHARS = 16
_ITEM = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
_KEY = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")


def separators_problem(value: Any) -> str | None:
    """Why `value` is not an (item, key) separator pair, or None when it is one: a comma and a colon,
    each with JSON whitespace only around it, at most MAX_SEPARATOR_CHARS characters."""
    if not isinstance(value, tuple) or len(value) != 2 or not all(isinstance(s, str) for s in value):
        return f"must be two strings (item separator, key separator), got {value!r:.60}"
    item, key = value
    if len(item) > MAX_SEPARATOR_CHARS or len(key) > MAX_SEPARATOR_CHARS:
        return f"each separator may have at most {MAX_SEPARATOR_CHARS} characters"
    if not _ITEM.fullmatch(item):
        return f"the item separator must be a comma with JSON whitespace around it only, got {item!r}"
    if not _KEY.fullmatch(key):
        return f"the key separator must be a colon with JSON whitespace around it only, got {key!r}"
    return None


# A prompt: text (tokenized as the tokenizer's own call does, BOS included) or token ids.
Prompt = str | list[int]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample one request. `temperature=0` is greedy.

    >>> SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1, stop=["\\n\\n"])
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N log-probabilities per generated token (of the raw model output)
    # Log-probability of each prompt token given the ones before it, with the top-N there (0: the token's
    # own only): scoring a text under a context. Its prompt is computed whole, past the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Guided decoding: at most one of these.
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # Isolates prefix-cache entries between tenants: blocks are shared only under equal salts.
    cache_salt: str | None = None
    # Guided output closes validly within max_tokens (and the context): once the budget gets down to the
    # shortest valid completion, only tokens that keep one within it are taken (asyncpage.guided.budget).
    # finish_reason is "length" when the budget forced the close. Both backends; every guided kind.
    budget_close: bool = True
    # Runaway guards under json_schema (0 = off; each is off anyway where the schema asks for long values):
    # a number's digit run may not exceed this many digits...
    max_number_digits: int = 15
    # ...and a string whose tail repeats one n-gram (1-8 tokens) this many times is ended, where allowed.
    max_string_repeats: int = 8
    # Under `grammar`: its output is JSON (a Lark grammar of `%json` blocks, as extraction's copied-field and
    # retry grammars are), so both guards apply to it as under json_schema.
    json_guards: bool = False
    # JSON's spelling under json_schema (and chat's response_format and tool arguments): the (item, key)
    # separators, json.dumps' by default, the spelling models read most; (",", ":") is compact JSON. Each is
    # a comma / a colon with JSON whitespace only around it; no other whitespace is free anywhere.
    json_separators: tuple[str, str] = DEFAULT_SEPARATORS
    # Under json_schema (and chat's response_format and tool arguments): an object schema that declares
    # `properties` and says nothing of `additionalProperties` takes no other key, and a `prefixItems` tuple
    # that says nothing of `items` no other item (xgrammar's strict mode, vLLM's default): a small model
    # would invent keys until max_tokens. False: JSON Schema's open default. An explicit
    # `additionalProperties` (true or a schema) is always kept (asyncpage.guided.style.closed_objects).
    json_closed_objects: bool = True

    def __post_init__(self) -> None:
        # Accept the natural spellings (a str, a list, None for "none") and store tuples: the struct is
        # frozen and hashable parts keep it safe to share between the caller and the engine thread.
        if isinstance(self.json_separators, list):  # a JSON body's pair
            msgspec.structs.force_setattr(self, "json_separators", tuple(self.json_separators))
        for name in ("stop", "stop_token_ids", "choice"):
            value = getattr(self, name)
            if value is None:
                if name != "choice":
                    msgspec.structs.force_setattr(self, name, ())
            elif isinstance(value, str):
                if name == "stop_token_ids":
                    raise InvalidRequestError(name, f"must be a list of token ids, got {value!r}")
                msgspec.structs.force_setattr(self, name, (value,))  # one stop string / one choice
            elif not isinstance(value, tuple):
                try:
                    msgspec.structs.force_setattr(self, name, tuple(value))
                except TypeError:
                    raise InvalidRequestError(name, f"must be a list, got {type(value).__name__}") from None
        _check(self)
        # Stored as floats: an int (10**30 from a JSON body) would reach torch as int64 and overflow in
        # the sampler, which runs for the whole batch (one request's value must never stop the engine).
        for name in _FLOAT_FIELDS:
            msgspec.structs.force_setattr(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        # Below this, float32 division by the temperature overflows (1e-46 rounds to 0): it is greedy.
        return self.temperature < GREEDY_BELOW

    @property
    def guided(self) -> bool:
        return any(x is not None for x in (self.json_schema, self.regex, self.choice, self.grammar))


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    # Finite only: NaN and inf in any sampling field turn logits into NaN rows downstream.
    if not isinstance(x, int | float) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past float's range (10**400): not a usable number either
        return False


def _check(p: SamplingParams) -> None:
    def bad(field: str, msg: str) -> InvalidRequestError:
        return InvalidRequestError(field, msg)

    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        raise bad("max_tokens", f"must be an integer >= 1, got {p.max_tokens!r}")
    if not _is_num(p.temperature) or not 0 <= p.temperature <= MAX_TEMPERATURE:
        raise bad("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {p.temperature!r}")
    if not _is_num(p.top_p) or not 0 < p.top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {p.top_p!r}")
    if not _is_int(p.top_k) or p.top_k < -1:
        raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {p.top_k!r}")
    if not _is_num(p.min_p) or not 0 <= p.min_p <= 1:
        raise bad("min_p", f"must be in [0, 1], got {p.min_p!r}")
    if p.seed is not None and not _is_int(p.seed):
        raise bad("seed", f"must be an integer or None, got {p.seed!r}")
    if not _is_int(p.n) or p.n < 1:
        raise bad("n", f"must be an integer >= 1, got {p.n!r}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    if any(not isinstance(s, str) or not s for s in p.stop):
        raise bad("stop", "every stop string must be a non-empty str")
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise bad("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(p.stop_token_ids)}")
    if any(not _is_int(t) or t < 0 for t in p.stop_token_ids):
        raise bad("stop_token_ids", "must be non-negative integers")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _is_num(v) or not -2 <= v <= 2:
            raise bad(name, f"must be in [-2, 2], got {v!r}")
    if not _is_num(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise bad("repetition_penalty", f"must be > 0, got {p.repetition_penalty!r}")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        if v is not None and (not _is_int(v) or not 0 <= v <= 20):
            raise bad(name, f"must be an integer in [0, 20] or None, got {v!r}")
    for name in ("budget_close", "json_guards"):
        if not isinstance(getattr(p, name), bool):
            raise bad(name, f"must be a bool, got {getattr(p, name)!r}")
    for name in ("max_number_digits", "max_string_repeats"):
        v = getattr(p, name)
        if not _is_int(v) or v < 0:
            raise bad(name, f"must be an integer >= 0 (0 turns the guard off), got {v!r}")
    guided = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(p, n) is not None]
    if len(guided) > 1:
        raise bad(guided[1], f"at most one of json_schema, regex, choice, grammar; got {guided}")
    if p.choice is not None and (not p.choice or any(not isinstance(c, str) or not c for c in p.choice)):
        raise bad("choice", "must be a non-empty list of non-empty strings")
    if p.json_schema is not None and not isinstance(p.json_schema, dict | bool):
        raise bad("json_schema", "must be a JSON Schema dict")
    for name in ("regex", "grammar", "cache_salt"):
        v = getattr(p, name)
        if v is not None and not isinstance(v, str):
            raise bad(name, f"must be a str, got {type(v).__name__}")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise bad(name, "must be valid Unicode (no unpaired surrogates)") from None
    problem = separators_problem(p.json_separators)
    if problem is not None:
        raise bad("json_separators", problem)
    for name in ("ignore_eos", "skip_special_tokens", "json_closed_objects"):
        if not isinstance(getattr(p, name), bool):
            raise bad(name, f"must be true or false, got {getattr(p, name)!r}")
