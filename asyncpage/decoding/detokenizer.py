"""Incremental detokenization and stop strings, per sequence.

tokenizers' DecodeStream does the hard part (it buffers byte-fallback pieces until they form valid
UTF-8, so a multi-byte character is never split and no text is re-emitted). On top of it this keeps
the text, finds stop strings that span token boundaries, and holds back a tail that could still be
the start of a stop string, so a stop string never leaks into the output.

DecodeStream.step raises "Invalid prefix encountered" on some real token sequences (Gemma 3's
byte-fallback pieces, vLLM #17448: its decoded text is not monotonic). That is one request's text, never
a reason to stop the engine: `_step` restarts the stream after the text so far and steps again (as vLLM's
`_protected_step` does), dropping the incomplete bytes that could no longer become a character.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from typing import Any

from tokenizers.decoders import DecodeStream

from asyncpage.params import SamplingParams

log = logging.getLogger("asyncpage")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizers.Tokenizer
        # Seeded with the prompt's tail: some decoders (SentencePiece's Metaspace) drop a leading
        # space on the first token of a stream, which would be wrong mid-text.
        # Cut at a character boundary: a prompt of token ids may end inside a multi-byte character, whose
        # leftover bytes would otherwise come out as U+FFFD at the head of the output.
        self._skip_special = skip_special_tokens
        self._context = self._clean(prompt_ids[-8:])
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        # What the DecodeStream may still hold back: the ids fed since it last returned text, after
        # the ids that text ended with (the context they decode in). finish() flushes them.
        self._last: list[int] = list(self._context)
        self._pending: list[int] = []
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        # Stop strings by their first character: only a tail starting with one can be held back.
        self._stops_by_first: dict[str, list[str]] = defaultdict(list)
        for s in stop:
            self._stops_by_first[s[0]].append(s)
        self.num_recoveries = 0  # DecodeStream restarts (see _step)
        self.text = ""  # all text decoded so far (may run past a stop string until truncated)
        self.emitted = 0  # chars of `text` already handed to the caller
        self.stopped = False

    def fork(self) -> IncrementalDetokenizer:
        """A fresh detokenizer for a forked sample (forks happen before any output exists)."""
        assert not self.text, "fork after output"
        clone = copy.copy(self)
        clone._stream = DecodeStream(ids=self._context, skip_special_tokens=self._skip_special)
        clone._last, clone._pending = list(self._context), []  # its own lists: add() appends in place
        return clone

    def add(self, token_id: int, is_stop_token: bool = False) -> str:
        """Feed one token; return the text that is now safe to emit (maybe empty).
        After a stop string is found, `stopped` is set and the text is cut before it."""
        if self.stopped:
            return ""
        if not is_stop_token:
            piece = self._step(token_id)
            if piece:
                self.text += piece
                self._last, self._pending = [token_id], []
            else:
                self._pending.append(token_id)
        self._check_stop()
        return self._release(final=self.stopped)

    def _clean(self, ids: list[int]) -> list[int]:
        """`ids` cut back to a character boundary: a context ending inside a multi-byte character would
        put its leftover bytes (U+FFFD) at the head of what follows."""
        ids = list(ids)
        while ids and self._backend.decode(ids, skip_special_tokens=self._skip_special).endswith("\ufffd"):
            ids.pop()
        return ids

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:  # "Invalid prefix encountered", OverflowError: the stream's state is broken
            first = exc
        # Restart after the text so far: in the context of the ids the last text ended with (so a
        # Metaspace decoder keeps this token's leading space), then with none. The pending ids are
        # dropped: they were bytes of a character the new token did not complete.
        self.num_recoveries += 1
        self._pending = []
        for ids in (self._clean(self._last), []):
            self._stream = DecodeStream(ids=ids, skip_special_tokens=self._skip_special)
            self._last = list(ids)
            try:
                return self._stream.step(self._backend, token_id)
            except Exception:
                continue
        log.warning("token %d cannot be detokenized after the text so far (%s); it adds no text", token_id, first)
        self._stream = DecodeStream(ids=[], skip_special_tokens=self._skip_special)
        self._last = []
        return None

    def finish(self) -> str:
        """The sequence ended: release what was held back, the DecodeStream's incomplete bytes too
        (a character cut by max_tokens), spelled as the tokenizer's decode() spells them: U+FFFD."""
        if not self.stopped and self._pending:
            skip = self._skip_special
            whole = self._backend.decode(self._last + self._pending, skip_special_tokens=skip)
            before = self._backend.decode(self._last, skip_special_tokens=skip)
            self._pending = []
            if whole.startswith(before):
                self.text += whole[len(before):]
                self._check_stop()  # the flushed tail may complete a stop string
        return self._release(final=True)

    def _check_stop(self) -> None:
        if not self._stop:
            return
        # Only the new tail can complete a stop string: search from where one could start.
        start = max(0, self.emitted - self._max_stop)
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final and self._stop:
            end -= self._held_tail()
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_tail(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        text = self.text
        # Longest first; only starts whose character opens some stop string are tried, so the work
        # per token is bounded by the stops' count x length (both capped in SamplingParams).
        for n in range(min(self._max_stop - 1, len(text) - self.emitted), 0, -1):
            stops = self._stops_by_first.get(text[-n])
            if stops and any(s.startswith(text[-n:]) for s in stops if len(s) > n):
                return n
        return 0


class StopStrings:
    """Beam search's stop strings: whether a finished output's text holds one (a beam is detokenized
    whole, not incrementally). Handed to the scheduler, which steps beams."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def hit(self, token_ids: list[int], params: SamplingParams) -> bool:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
        return any(s in text for s in params.stop)
