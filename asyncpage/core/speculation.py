"""The scheduler's half of speculative decoding: which sequences speculate, with how many drafts,
and what each verification did (the proposers are speculative.py's n-gram lookup and draft.py's
model; verification is speculative.verify, on the compute thread)."""

from __future__ import annotations

import logging

from asyncpage.core.request import SeqStatus, Sequence
from asyncpage.decoding.ngram import TokenForms
from asyncpage.decoding.speculative import DraftAsk, SpecState, SpeculativeConfig
from asyncpage.kv.cache import KVCacheManager

log = logging.getLogger("asyncpage")

# Speculate after a pending run of at most this many tokens (a decode has 1; grammar fast-forward
# leaves a few): longer ones are prefill chunks, whose own cost dwarfs what drafts could save.
FORCED_RUN = 16


class Speculation:
    def __init__(self, config: SpeculativeConfig | None, kv: KVCacheManager, max_model_len: int,
                 forms: TokenForms | None = None) -> None:
        """`forms`: the tokenizer's view of tokens for the n-gram lookups (None: compared by id)."""
        self.config, self.kv, self.max_model_len, self.forms = config, kv, max_model_len, forms
        self.proposed = 0  # drafts verified, over all sequences
        self.accepted = 0  # drafts kept
        self.verify_steps = 0  # sequence-steps that verified drafts

    def active(self, num_running: int) -> bool:
        """Drafts are off while more sequences run than `disable_by_batch_size` (speculative.py)."""
        return self.config is not None and num_running <= self.config.disable_by_batch_size

    def room(self, seq: Sequence) -> int:
        """How many drafts a sequence may take now (0: it does not speculate)."""
        req, p = seq.request, seq.params
        if self.config is None or req.beam is not None or p.logprobs is not None or (
                seq.spec is not None and seq.spec.broken):
            return 0
        if req.width > 1 and not req.forked:
            return 0  # the step that forks its n samples: each speculates on its own from the next
        if seq.spec is None:
            seq.spec = SpecState(self.config, self.forms)
        return min(seq.spec.k, p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for a decoding sequence (n-gram lookup over its own tokens, or what the draft model
        proposed): at most `room`, never past max_tokens or the context, cut where the grammar refuses
        one or at a stop token. After a pending run (tokens a grammar forced), its rows and the drafts are
        together at most num_speculative_tokens + 1, a plain verify's rows: a step of more rows runs other
        kernels than one-token steps (model/batch.py EXACT_ROWS), and greedy output would no longer be
        what it is without speculation."""
        room = min(room, self.room(seq), self.rows_left(seq))
        if room <= 0:
            return []
        spec = seq.spec
        assert spec is not None
        try:
            ending = spec.ending(seq.token_ids) if seq.matcher is not None and spec.config.method == "ngram" else None
            draft = self._stopped(seq, spec.propose(seq.token_ids, room))
            if seq.matcher is None or not draft:
                return draft
            valid = seq.matcher.valid_prefix(draft)
            if valid < len(draft) and spec.config.method == "ngram" and spec.refused(len(seq.token_ids), draft[:valid]):
                return self._past_end(seq, draft[:valid], ending, room)
            if valid == 0 and spec.by_label:
                return self._opened(seq, draft, room)
            return draft[:valid]
        except Exception:  # a proposer's fault costs this sequence its drafts, never the engine
            log.exception("speculative proposal failed: this sequence goes on without drafts")
            spec.broken = True
            return []

    def _stopped(self, seq: Sequence, draft: list[int]) -> list[int]:
        """`draft` up to its first stop token."""
        return draft[: next((i for i, t in enumerate(draft) if t in seq.request.stop_ids), len(draft))]

    def _past_end(self, seq: Sequence, kept: list[int], ending: int | None, room: int) -> list[int]:
        """The grammar refused the draft after `kept`: the source the lookup copied from runs on with what
        the output cannot hold there (a record's field, copied into a JSON string, ends in a line break).
        The value most likely ends there: the drafts go on with the token the model wrote at such ends
        before (`",`), the run the grammar then forces (` "email":`) and what the lookups propose after
        it (the next field's value, found by its label); verify() keeps a forced run the drafts hold.
        `kept` alone when no ending is known yet or the grammar refuses it here."""
        assert seq.matcher is not None and seq.spec is not None
        if ending is None or len(kept) >= room or ending in seq.request.stop_ids:
            return kept
        m = seq.matcher.fork()
        if not all(m.accept(t) for t in kept) or not m.accept(ending) or m.is_terminated():
            return kept
        forced = self._stopped(seq, m.forced_tokens())
        out = [*kept, ending, *forced][:room]
        if len(out) < room:
            more = self._stopped(seq, seq.spec.propose(seq.token_ids + out, room - len(out), len(seq.token_ids)))
            n = m.valid_prefix(forced + more) - len(forced)
            out += more[: max(0, n)]
        return out

    def _opened(self, seq: Sequence, draft: list[int], room: int) -> list[int]:
        """A field's value drafted from its label (`"address":` then what follows "Address:" in the record) that
        the grammar refuses as it stands: before any value of this kind was written, nothing says which token
        opens it after the key (` "` for a string, ` ["` for a list of them). The first opener (TokenForms.openers)
        the grammar takes that lets the value's first token follow (without its leading space after a quote)
        opens the drafts; none: no drafts."""
        assert seq.matcher is not None
        f, stops = self.forms, seq.request.stop_ids
        if f is None or room < 2:
            return []
        if f.separator(draft[0]):
            draft = draft[1:]  # a separator learned after other keys (` "`): this value opens otherwise
        if not draft:
            return []
        for opener in f.openers():
            m = seq.matcher.fork()
            first = f.unspaced(draft[0]) if f.opens(opener) else draft[0]
            if first is not None and opener not in stops and first not in stops and m.accept(opener) \
                    and not m.is_terminated() and m.accept(first):
                rest = draft[1 : room - 1]
                return [opener, first, *rest[: m.valid_prefix(rest)]]
        return []

    def rows_left(self, seq: Sequence) -> int:
        """Drafts that fit beside the sequence's pending run (its last token, or a forced run)."""
        assert self.config is not None
        return self.config.num_speculative_tokens + 1 - (seq.num_tokens - seq.num_computed_tokens)

    def draft_asks(self, running: list[Sequence]) -> list[DraftAsk]:
        """The running sequences that will decode next step and may speculate, for the draft model
        (method "draft"; the engine loop runs it just before schedule())."""
        if self.config is None or self.config.method != "draft" or not self.active(len(running)):
            return []
        asks = []
        for seq in running:
            pending = seq.num_tokens - seq.num_computed_tokens
            if seq.status is not SeqStatus.RUNNING or pending <= 0 or (k := self.room(seq)) <= 0:
                continue
            # A prompt still prefilling: the draft reads it meanwhile (k=0), so it drafts from the first decode.
            asks.append(DraftAsk(seq.seq_id, list(seq.token_ids), max(0, min(k, self.rows_left(seq))),
                                 seq.params.cache_salt))
        return asks

    def set_drafts(self, running: list[Sequence], drafts: dict[int, list[int]]) -> None:
        for seq in running:
            if seq.spec is not None:
                seq.spec.pending = drafts.get(seq.seq_id, [])

    def verified(self, seq: Sequence, computed: int, proposed: int, kept: int) -> None:
        """A speculating sequence's step is over: its `computed` tokens and `kept` drafts are in the cache
        (the slots written for rejected drafts are garbage, overwritten when those positions are
        computed again); only their full blocks enter the prefix cache, and blocks holding nothing
        but rejected drafts go back to the pool."""
        seq.num_computed_tokens = min(seq.num_computed_tokens + computed + kept, seq.num_tokens)
        self.kv.cache_full_blocks(seq.table, seq.token_ids, seq.num_computed_tokens, seq.params.cache_salt)
        self.kv.trim(seq.table, seq.num_tokens)
        assert seq.spec is not None
        seq.spec.observe(proposed, kept)
        seq.request.spec_proposed_tokens += proposed
        seq.request.spec_accepted_tokens += kept
        seq.request.spec_verify_steps += 1
        self.proposed += proposed
        self.accepted += kept
        self.verify_steps += 1
