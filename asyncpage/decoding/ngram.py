"""The n-gram proposer of speculative decoding (prompt lookup): where a sequence's last tokens occurred
before in its own tokens (prompt and output), what followed them there is the draft.

Three lookups, in order; the first that finds a usable match proposes:

1. n-grams, the longest first (prompt_lookup_max down to prompt_lookup_min), compared by a token's
   form: its text without the tokenizer's leading-space mark, so " Margaret" in a record and "Margaret"
   right after a JSON string's opening quote are one word (the model writes a copied value's first
   token without its space: compared by id, the copy was found only from its third token on);
2. the last token alone, when it is a word of at least WORD_CHARS characters ("Margaret", "marg");
3. a label: when the sequence ends in separators after a word (`"address": "`), the same word earlier,
   case aside, followed by separators (`Shipping address: `): what follows those separators there (a
   record's field, copied into a structured output under its own name), its first token without its
   leading space when the sequence's last token already ends in a space or an opening quote, after the
   separator that most often followed the sequence's last one (`":` then ` "`); tried before a match of
   separators alone.

A match is used only when its last two occurrences were followed by the same token: `": "` before each
of a JSON object's values (separators a grammar forces) predicts nothing from its second value on, and
the lookup goes on; a loop that repeats itself predicts from its second turn. What each lookup gave on
`asyncpage bench --speculative ngram`: docs/performance.md.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any, NamedTuple

INDEX_PER_CALL = 2048  # tokens indexed per proposal at most (~5 us each: ~10 ms)
LABEL_GAP = 8  # separators between a label and the end looked back over at most
WORD_CHARS = 3  # the shortest form a one-token lookup (2.) takes: shorter ones ("1", "OR") recur everywhere
SEPARATORS = frozenset(" \t\r\n:=\"'[{")  # what stands between a label and its value
_SPACE_MARKS = ("\u2581", "\u0120")  # SentencePiece's and byte-level BPE's leading space
_BYTE_MARKS = {"\u010a": "\n", "\u0109": "\t", "\u010d": "\r"}  # byte-level BPE's newline, tab, CR
_OPENERS = frozenset(" \t\n\"'([{")


class _Form(NamedTuple):
    """One token as the proposer reads it."""

    form: str  # its text without the leading-space mark
    folded: str  # the same, case-folded (labels)
    word: bool  # it holds a letter or digit
    separator: bool  # only SEPARATORS
    opens: bool  # ends in a space or an opening quote or bracket
    starts_word: bool  # starts with a space, a sign or a character past ASCII


class TokenForms:
    """What the proposer reads of a token beyond its id, from the tokenizer's vocabulary, looked up once
    per token id on first sight (a dict each: the loop's own, never shared with other threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        """`vocab_size`: the model's rows; a token id the tokenizer names past them is never drafted."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._info: dict[int, _Form] = {}
        self._unspaced: dict[int, int | None] = {}
        self._openers: list[int] | None = None
        self._special = _special_ids(tokenizer)

    def _read(self, t: int) -> _Form:
        info = self._info.get(t)
        if info is None:
            try:
                raw = self._tokenizer.convert_ids_to_tokens(t)
            except Exception:  # an id the vocabulary lacks (a model's padded rows): a form of its own
                raw = None
            if isinstance(raw, str) and len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
                try:  # a byte-fallback token: "<0x0A>" is a newline
                    raw = chr(int(raw[3:5], 16)) if int(raw[3:5], 16) < 128 else raw
                except ValueError:
                    pass
            if not isinstance(raw, str) or not raw or t in self._special:
                info = _Form(f"\0{t}", f"\0{t}", False, False, False, True)
            else:
                text = raw
                for mark, byte in _BYTE_MARKS.items():
                    text = text.replace(mark, byte)
                for mark in _SPACE_MARKS:
                    text = text.replace(mark, " ")
                form = text.lstrip(" ") or text
                info = _Form(form, form.casefold(), any(c.isalnum() for c in form), all(c in SEPARATORS for c in text),
                             text[-1] in _OPENERS, not (text[0].isalnum() and text[0].isascii()))
            self._info[t] = info
        return info

    def form(self, t: int) -> str:
        return self._read(t).form

    def folded(self, t: int) -> str:
        return self._read(t).folded

    def word(self, t: int) -> bool:
        return self._read(t).word

    def separator(self, t: int) -> bool:
        return self._read(t).separator

    def starts_word(self, t: int) -> bool:
        """Its text starts with a space, a sign or a character past ASCII (a byte-level BPE's bytes of an
        emoji read as letters): it is not the continuation of the word before it ("E" "mail" is one word,
        "Email" "Ġaddress" two)."""
        return self._read(t).starts_word

    def opens(self, t: int) -> bool:
        """Its text ends in a space or an opening quote or bracket: what follows starts without a space."""
        return self._read(t).opens

    def openers(self) -> list[int]:
        """The vocabulary's tokens that open a JSON value after a key's colon (` "`, ` [`, ` ["`, `"`, ...: a quote or
        a bracket, with the tokenizer's own space mark or none), looked up once."""
        if self._openers is None:
            found: list[int] = []
            for text in ('"', '["', "[", '{"', "{"):
                for lead in ("", *_SPACE_MARKS):
                    try:
                        t = self._tokenizer.convert_tokens_to_ids(lead + text)
                        same = isinstance(t, int) and self._tokenizer.convert_ids_to_tokens(t) == lead + text
                    except Exception:  # a vocabulary without such a token
                        same = False
                    if same and t not in found and (self._vocab_size is None or 0 <= t < self._vocab_size):
                        found.append(t)
            self._openers = found
        return self._openers

    def unspaced(self, t: int) -> int | None:
        """The same token without its leading-space mark (" Margaret" -> "Margaret"), itself when it has
        none, None when the vocabulary has no such token."""
        if t not in self._unspaced:
            out: int | None = t
            try:
                raw = self._tokenizer.convert_ids_to_tokens(t)
                if isinstance(raw, str) and raw[:1] in _SPACE_MARKS and len(raw) > 1:
                    other = self._tokenizer.convert_tokens_to_ids(raw[1:])
                    unk = getattr(self._tokenizer, "unk_token_id", None)
                    out = other if isinstance(other, int) and other != unk and 0 <= other < (
                        self._vocab_size if self._vocab_size is not None else other + 1) else None
            except Exception:  # an id the vocabulary lacks: drafted as it is
                out = t
            self._unspaced[t] = out
        return self._unspaced[t]


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """A chat template's markers and the other special tokens ("<end_of_turn>", "<|im_end|>"): no words of a
    record's, nor separators. `all_special_ids` and the added tokens marked special (Gemma 3's turn markers are
    only the latter); an entry that is no id is skipped, a tokenizer that cannot say gives none."""
    ids: list[Any] = []
    for read in (lambda: list(getattr(tokenizer, "all_special_ids", None) or ()),
                 lambda: [i for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                          if getattr(tok, "special", False) is True]):
        try:
            ids += read()
        except Exception:  # a tokenizer that cannot say: its tokens read by their text
            continue
    found = set()
    for i in ids:
        try:
            found.add(operator.index(i))
        except TypeError:
            continue
    return frozenset(found)


class NgramIndex:
    """One sequence's lookups: where each n-gram of its tokens (by form) and each label last ended, and
    whether what followed them always agreed, extended as tokens arrive (tokens only ever append)."""

    def __init__(self, lookup_min: int, lookup_max: int, forms: TokenForms | None) -> None:
        self.lookup_min, self.lookup_max, self.forms = lookup_min, lookup_max, forms
        # n -> gram -> (where its latest occurrence ended, the form after it, whether the occurrence before
        # had that form after it too)
        self._grams: dict[int, dict[tuple[object, ...], tuple[int, object, bool]]] = {}
        self._labels: dict[str, tuple[int, object, bool]] = {}  # folded word -> the same for its value
        self._bridges: dict[int, Counter[int]] = {}  # separator token -> the separator tokens that followed it
        self._keys: list[object] = []  # each indexed token's form
        self._label: str | None = None  # the last word (its tokens' folded forms), while only separators followed
        self._label_len = 0  # the tokens of the word the index is in (0: not in a word)
        self._gap = False  # at least one separator since that word
        self._braced = False  # one of those separators opens an object: what follows is its first key, no value
        self._indexed = 0  # tokens before this position are in the index
        self.by_label = False  # the last proposal came from a label (3.): a value's start, not a copy's middle

    def _key(self, t: int) -> object:
        return t if self.forms is None else self.forms.form(t)

    def _note(self, table: dict[Any, tuple[int, object, bool]], key: object, end: int, after: object) -> None:
        seen = table.get(key)
        table[key] = (end, after, seen is None or seen[1] == after)

    def extend(self, tokens: list[int], stop: int) -> None:
        """Index tokens[:stop] not yet indexed, at most INDEX_PER_CALL of them (a long prompt is indexed
        over its first steps, not in one stall of the engine loop; drafts meanwhile come from what is
        indexed). A token joins only once all its entries are made: a failure leaves the index whole."""
        f = self.forms
        keys = self._keys
        one_all = self.lookup_min <= 1
        for e in range(self._indexed, min(stop, self._indexed + INDEX_PER_CALL)):
            t = tokens[e]
            key = self._key(t)
            # Every n-gram ending just before e, with what follows it (token e); one token alone only where
            # lookup 2. can use it.
            for n in range(1, self.lookup_max + 1):
                if e >= n and (n > 1 or one_all or self._word(tokens[e - 1])):
                    self._note(self._grams.setdefault(n, {}), tuple(keys[e - n : e]), e, key)
            if f is not None:
                if f.separator(t):
                    if e and f.separator(tokens[e - 1]):
                        self._bridges.setdefault(tokens[e - 1], Counter())[t] += 1
                    self._gap = True
                    self._braced = self._braced or "{" in f.form(t)
                else:
                    # A label's value; not where an object opens after it ("... payment, notes:\n" then the
                    # output's `{"customer`: the key is no value of "notes", and made its lookup disagree)
                    if self._label is not None and self._gap and not self._braced and not f.form(t).startswith("\0"):
                        self._note(self._labels, self._label, e, key)  # a template's marker is no value either
                    if not f.word(t):
                        self._label, self._label_len = None, 0
                    elif self._label_len and not self._gap and not f.starts_word(t):
                        # A word in several tokens ("E" "mail"); past the LABEL_GAP + 1 tokens a lookup joins,
                        # no label at all (its tail could match a shorter one), to the word's end.
                        self._label_len += 1
                        self._label = self._label + f.folded(t) if (
                            self._label is not None and self._label_len <= LABEL_GAP + 1) else None
                    else:
                        self._label, self._label_len = f.folded(t), 1
                    self._gap = self._braced = False
            keys.append(key)
            self._indexed = e + 1

    def _word(self, t: int) -> bool:
        """A token the one-token lookup (2.) takes: a word of at least WORD_CHARS characters."""
        f = self.forms
        return f is not None and f.word(t) and len(f.form(t)) >= WORD_CHARS

    def propose(self, tokens: list[int], k: int, known: int | None = None) -> list[int]:
        """Up to k drafts to follow `tokens` (the tokens indexed so far plus any not yet), [] when no
        lookup finds a usable match. `known`: tokens past it are drafts themselves (a proposal that goes
        on past a run the grammar forces), looked up from but never indexed."""
        end = len(tokens)
        self.by_label = False
        if end < 1 or k <= 0:
            return []
        # n-grams ending before the last position: a suffix must not match itself
        self.extend(tokens, end - 1 if known is None else min(end - 1, known))
        suffix = [self._key(t) for t in tokens[-self.lookup_max :]]
        f = self.forms
        for n in range(min(self.lookup_max, end - 1), 0, -1):
            if n < self.lookup_min and not (n == 1 and self._word(tokens[-1])):
                continue
            hit = self._grams.get(n, {}).get(tuple(suffix[-n:]))
            if hit is not None and hit[2]:
                if f is not None and all(f.separator(t) for t in tokens[-n:]):
                    # Separators alone (`": "` after a key): a label before them says more.
                    return self._label_draft(tokens, k) or tokens[hit[0] : hit[0] + k]
                return tokens[hit[0] : hit[0] + k]
        return self._label_draft(tokens, k) if f is not None else []

    def _label_draft(self, tokens: list[int], k: int) -> list[int]:
        f = self.forms
        assert f is not None
        i = len(tokens) - 1
        while i >= len(tokens) - LABEL_GAP and i >= 0 and f.separator(tokens[i]):
            if "{" in f.form(tokens[i]):
                return []  # an object opens after the word: its first key is due, no value (as extend notes none)
            i -= 1
        if i == len(tokens) - 1 or i < 0 or not f.word(tokens[i]):
            return []
        start = i  # the word's first token: back over the tokens that continue it
        while start > 0 and not f.starts_word(tokens[start]) and f.word(tokens[start - 1]):
            if i - start == LABEL_GAP:
                return []  # longer than any label the index keeps
            start -= 1
        hit = self._labels.get("".join(f.folded(t) for t in tokens[start : i + 1]))
        if hit is None or not hit[2] or hit[0] >= start:
            return []
        # The separator that followed the last one more than half of the times, once included (`":` then
        # ` "` before a JSON string from its first key on; the grammar leaves the space free, so it is not
        # forced): drafted first.
        bridge: list[int] = []
        seen = self._bridges.get(tokens[-1])
        if seen:
            (t, times), = seen.most_common(1)
            if 2 * times > sum(seen.values()):
                bridge = [t]
        draft = tokens[hit[0] : hit[0] + k - len(bridge)]
        if draft and f.opens(bridge[-1] if bridge else tokens[-1]):
            first = f.unspaced(draft[0])
            if first is None:
                return []
            draft[0] = first
        self.by_label = bool(draft)
        return (bridge + draft)[:k]
