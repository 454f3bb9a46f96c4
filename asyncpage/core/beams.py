"""The scheduler's beam half (a mixin of Scheduler): one step of a beam search chooses among all its
beams' continuations at once (decoding/beam.py's rules), forks a beam chosen twice, frees one nobody
chose, and ends the search's beams on its stops."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from asyncpage.core.request import Request, Sequence
from asyncpage.decoding.beam import Choice
from asyncpage.outputs import FinishReason

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncpage.decoding.detokenizer import StopStrings
    from asyncpage.kv.cache import KVCacheManager

log = logging.getLogger("asyncpage")


class BeamSteps:
    kv: KVCacheManager
    running: list[Sequence]
    stop_strings: StopStrings | None
    max_model_len: int
    new_seq_id: Callable[[], int]
    finish: Callable[[Sequence, FinishReason], None]
    _stop_reason: Callable[[Sequence, int], FinishReason | None]

    def _step_beams(self, req: Request, candidates: dict[int, tuple[list[int], list[float]]],
                    ) -> list[tuple[Sequence, str]]:
        """One beam-search step: choose the next beams among every beam's continuations, then fork
        the chosen parents' block tables (shared blocks are referenced, not copied; a partly filled
        last block is copied when first written) and free the beams nobody chose."""
        search = req.beam
        assert search is not None
        beams = req.seqs
        p = req.params
        outputs = [b.output_token_ids for b in beams]

        def ends(parent: int, token: int) -> tuple[FinishReason | None, bool] | None:
            if token in req.stop_ids:
                m = beams[parent].matcher
                # EOS where the grammar is not complete: a copied field's opening quote where no span
                # fits leaves only EOS. That is half a value, not a hypothesis: dropped. A caller's own
                # stop id ends the beam as it ends a greedy sample; EOS stays a dead end when the
                # caller also lists it among its stop ids (req.stop_token_ids: the EOS ids).
                eos = not p.ignore_eos and token in req.stop_token_ids
                dead_end = m is not None and not m.is_accepting() and eos
                return (None if dead_end else "stop"), False
            if p.stop and self.stop_strings is not None and self.stop_strings.hit(outputs[parent] + [token], p):
                return "stop", True
            if beams[parent].num_tokens + 1 >= self.max_model_len:
                return "length", True
            return None

        choices = search.step(outputs, [candidates.get(b.seq_id, ([], [])) for b in beams], ends)
        # The chosen beams are the request's at once: a fault below fails them all (forks included), none is left
        # holding its blocks.
        req.seqs = nxt = self._follow(req, beams, choices)
        failures: list[tuple[Sequence, str]] = []
        refused: list[tuple[Sequence, str]] = []
        for i in range(len(nxt) - 1, -1, -1):  # from the end: retire() renumbers the beams after i
            b = nxt[i]
            if b.matcher is not None and not b.matcher.accept(b.token_ids[-1]):
                # Its mask allowed the token, its matcher refused it: the matcher is in its error state (an
                # llguidance lexer out of fuel on a costly state). That beam cannot go on: it leaves the search
                # as a dead end does; the request fails only where no beam is left to finish it.
                get = getattr(b.matcher, "error", None)  # llguidance's says why; another backend's may not
                why = str(get()) if get is not None else ""
                refused.append((b, f"the grammar rejected token {b.token_ids[-1]} a beam search chose"
                                   + (f" ({why.splitlines()[0]})" if why else "")))
                log.warning("beam search %d: %s; that beam leaves the search", req.request_id, refused[-1][1])
                search.retire(i, b.output_token_ids, "stop", valid=False)
                nxt.pop(i)
                self.finish(b, "stop")
            elif b.matcher is not None and b.matcher.is_terminated():
                # Its grammar is complete (the beam ends), or at a dead end: a copied field's opening
                # quote where no span of the record fits, and no token can follow. That beam is not a
                # value: it is dropped, never ranked against the complete ones.
                search.retire(i, b.output_token_ids, "stop", valid=b.matcher.is_accepting())
                nxt.pop(i)
                self.finish(b, "stop")
        if hopeless := search.hopeless():  # best_only: beams that cannot beat the best hypothesis found
            search.drop(hopeless)
            for i in reversed(hopeless):
                self.finish(nxt.pop(i), "stop")
        if refused and not nxt and not search.finished:
            failures.append(refused[0])
        for i, b in enumerate(nxt):
            b.index = i
        if failures or search.done:
            for b in nxt:
                self.finish(b, "stop")
        return failures[:1]

    def _follow(self, req: Request, beams: list[Sequence], choices: list[Choice]) -> list[Sequence]:
        """The sequences of the chosen continuations: a parent chosen once goes on itself, one chosen
        again is forked first (before its own token is appended); a parent nobody chose is freed."""
        req.forked = True
        taken: set[int] = set()
        nxt: list[Sequence] = []
        for c in choices:
            parent = beams[c.parent]
            if c.parent in taken:
                # Beams are detokenized whole when the search ends (OutputProcessor.beams), never as they go.
                nxt.append(parent.fork(self.new_seq_id(), len(nxt), self.kv.fork(parent.table), None, detokenize=False))
                self.running.append(nxt[-1])
            else:
                taken.add(c.parent)
                nxt.append(parent)
        for i, b in enumerate(beams):
            if i not in taken:
                self.finish(b, "stop")
        for b, c in zip(nxt, choices, strict=True):
            b.token_ids.append(c.token)
        return nxt
