"""Decisions by scoring: every closed choice of a value is decided by how likely the model finds each option,
calibrated on reference records, not by the first token the grammar allows (issue 35).

`Decider` (one per job) finds what is decided and measures each reading's offset on the reference records;
`Plan` (one per record) builds its probes and reads the outcome:

- a plain boolean: its statement read after the record (booleans.py), true when it beats its offset;
- an option among listed ones (closed.py): each option on its field's label line after the record, less its
  offset (contextual calibration), its softmax share mixed with an even share among the options the record
  names in its own words (closed.named: "This is critical"); the best wins, its mixed share the confidence;
- null or present, for a nullable copied field: its likeliest span on its label line, or the likeliest where the
  record names the field (with a digit for an id: near.near, labels.numbered), against " not given";
- where a copied value that may not be null ends (ends.py) and starts (starts.py), read on its described line;
- null or present, for a nullable field not copied: in context after its key in the JSON, per token.

The decided values replace what the model wrote (readings.applied) before the caller's type judges the value;
one the field's whole schema, or the caller's type, refuses is not applied (run.decode_value); a decision whose
probes could not run is left to the model. Why each, with figures: docs/extraction.md, "Decisions by scoring".
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncpage.extract import booleans as flags
from asyncpage.extract import ends, grounding, scales
from asyncpage.extract import retry as redo
from asyncpage.extract.closed import NAMED_WEIGHT, Closed, closed_fields
from asyncpage.extract.labels import anchors, doubt, labeled_id
from asyncpage.extract.near import near_grammar
from asyncpage.extract.probes import BEST_MAX_TOKENS, Probe, Scored, gather
from asyncpage.extract.prompt import REFERENCES
from asyncpage.extract.readings import (
    LINE_END,
    Context,
    Said,
    checker,
    described,
    logistic,
    mean,
    reading,
    value_grammar,
)
from asyncpage.extract.ruled import ruled
from asyncpage.extract.starts import Starts

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient
    from asyncpage.core.mailbox import Mailbox

# A copied value of more words keeps its end (a name, a brand, an id: not a paragraph). A subject line's tail
# ("Vireo Flask 750 lid leaks all over my bag every single day", 12 words) is within it.
MAX_END_WORDS = 12
_KEPT = 256  # offsets an engine keeps (engine.reading_offsets, shared with booleans.py)


class Decider:
    """A job's scored decisions and their offsets: `booleans` (booleans.py's readings), `choices` (options
    and null-or-present, closed.py). `schema`: the job's, with its copied fields marked."""

    def __init__(self, schema: dict[str, Any], *, booleans: bool, choices: bool) -> None:
        self.schema = schema
        self.readings = flags.statements(schema) if booleans else {}
        closed = closed_fields(schema) if choices else {}
        props = grounding.resolve(schema, schema).get("properties") or {}
        self.options: dict[str, dict[Said, Any]] = {}  # field -> {its reading: option}
        for name, c in closed.items():
            if c.present is None:
                p = grounding.resolve(schema, props[name])
                said = {reading(name, p, o): o for o in c.options}
                if len(said) == len(c.options):  # options that read the same (1 and "1") stay the grammar's
                    self.options[name] = said
        # A nullable copied field: read on its label line after the record (`spans`), others in context (`present`).
        self.spans: dict[str, tuple[str, dict[str, Any]]] = {}  # field -> (its label line, its present branch)
        for name, c in closed.items():
            if c.present is not None and c.present.get(grounding.COPY) is True:
                self.spans[name] = (reading(name, grounding.resolve(schema, props[name]), None).lead, c.present)
        self.anchors = {n: anchors(n, grounding.resolve(schema, props[n])) for n in self.spans}  # words that name it
        self.present: dict[str, Closed] = {n: c for n, c in closed.items()
                                           if c.present is not None and n not in self.spans}
        # A copied field that may not be null: where its span ends is read on its description's line (`ends`).
        self.ends: dict[str, str] = {}  # field -> its line's lead
        self.branches: dict[str, dict[str, Any]] = {}  # field -> its schema (what a span on its line must hold)
        for name, prop in props.items() if choices else ():
            p = grounding.resolve(schema, prop)
            if isinstance(p, dict) and p.get(grounding.COPY) is True and name not in self.spans:
                self.ends[name] = described(name, p)
                self.branches[name] = p
        self.brands = {n for n, lead in self.ends.items() if ends.names_a_brand(n, lead)}  # a name, no common noun
        self.offsets: dict[str, float] = {}  # a statement's (or a heading's) key -> its mean on the references
        self.margins: dict[str, float] = {}  # a null-or-present field -> its mean margin on the references
        decided = {*self.readings, *self.options, *self.spans, *self.present, *self.ends}
        self._checks = {name: checker(schema, prop) for name, prop in props.items() if name in decided}

    def holds(self, name: str, value: Any) -> bool:
        """Whether a decided value holds to its field's whole schema (else the model's own stands)."""
        check = self._checks.get(name)
        return check is not None and check(value)

    @property
    def active(self) -> bool:
        return bool(self.readings or self.options or self.present or self.spans or self.ends)

    def span_key(self, name: str) -> str:
        """The offset key of a copied field's label-line reading (its label and its branch's constraints)."""
        lead, branch = self.spans[name]
        return "span\0" + lead + json.dumps(branch, sort_keys=True, default=str)

    def _statements(self) -> list[Said]:
        said = [Said(*r.after) for r in self.readings.values() if r.described]
        return said + [s for opts in self.options.values() for s in opts]

    async def calibrate(self, engine: EngineClient, reference: Callable[[str], Awaitable[Context | None]] | None,
                        key: str = "", *, priority: int = 0, cache_key: str | None = None) -> None:
        """Measure the offsets on the reference records (once per engine: kept on it). `reference` decodes a
        reference record's value in the job's prompt (None: not possible, as for a prompt of the caller's own
        over other fields; its null-or-present fields are then left to the model); `key` names that prompt."""
        known = engine.reading_offsets
        found: dict[str, float | None] = {}  # this call's (the engine's cache is bounded: it may let them go)
        wanted = [s for s in self._statements() if s.key not in known]
        named = {n: r for n, r in self.readings.items() if not r.described and r.key not in known}
        spans = [n for n in self.spans if self.span_key(n) not in known]
        if wanted or named or spans:
            plans = [Plan(self, text, [text]) for text in REFERENCES]
            for plan in plans:
                plan.only(wanted, named, spans)
            await gather([p.run(engine, priority=priority, cache_key=cache_key) for p in plans])
            for plan in plans:
                plan.forget(engine)
            for s in wanted:
                got = [p.statement_score(s) for p in plans]
                found[s.key] = None if any(g is None for g in got) else mean(got)
            for name, r in named.items():
                gains = [p.named_gain(name) for p in plans]
                found[r.key] = None if any(g is None for g in gains) else mean(gains)
            for name in spans:
                margins = [p.span_margin(name) for p in plans]
                found[self.span_key(name)] = None if any(m is None for m in margins) else mean(margins)
        keys = [s.key for s in self._statements()] + [r.key for r in self.readings.values() if not r.described]
        keys += [self.span_key(n) for n in self.spans]
        self.offsets = {k: v for k in keys if (v := found[k] if k in found else known.get(k)) is not None}
        for k, v in found.items():
            _keep(known, k, v)
        if self.present and reference is not None:
            named_keys = {n: "present\0" + hashlib.sha256(json.dumps([n, key, self.schema], sort_keys=True, default=str)
                                                    .encode()).hexdigest() for n in self.present}
            if any(k not in known for k in named_keys.values()):
                contexts = await gather([reference(text) for text in REFERENCES])
                plans = [Plan(self, text, [text]) for text in REFERENCES]
                for plan, ctx in zip(plans, contexts, strict=True):
                    plan.only([], {})
                    if ctx is not None:
                        plan.add_context(engine, ctx)
                await gather([p.run(engine, priority=priority, cache_key=cache_key) for p in plans])
                for name, k in named_keys.items():
                    got = [p.margin(name) for p in plans]
                    found[k] = None if any(m is None for m in got) else mean(got)
                    _keep(known, k, found[k])
            self.margins = {n: v for n, k in named_keys.items()
                            if (v := found[k] if k in found else known.get(k)) is not None}


def _keep(known: dict[str, float | None], key: str, value: float | None) -> None:
    if len(known) >= _KEPT:
        known.clear()  # bounded: a job's schema has a few; a server's callers may send many
    known[key] = value


class Plan:
    """One record's scored decisions: its probes (statements after `text` first, in-context ones once its value
    is generated: `add_context`), then `outcome`. `sources`: the texts its copied fields come from."""

    def __init__(self, decider: Decider, text: str, sources: Sequence[str]) -> None:
        self.d, self.text, self.sources = decider, text.strip(), list(sources)
        self.waves: list[list[Probe]] = []  # to submit, each once the ones before it are done
        self.live: list[Probe] = []  # the wave in flight
        self.now: list[Probe] = []  # to submit at once (the in-context probes: their context is cached already)
        self.sent: list[Probe] = []  # every probe submitted
        self.said: dict[Said, Probe] = {}  # a reading -> its probe
        self.headings: dict[str | None, Probe] = {}  # named boolean (None: the plain heading) -> its probe
        self.nulls: dict[str, Probe] = {}
        self.best: dict[str, Probe] = {}
        self.bridge: dict[str, str] = {}
        self.wrote: dict[str, Any] = {}  # what the model wrote in the present fields
        self.line_nulls: dict[str, Probe] = {}  # a copied field -> " not given" on its label line
        self.line_best: dict[str, Probe] = {}  # a copied field -> the likeliest span on its label line
        self.line_near: dict[str, Probe] = {}  # a copied field -> its likeliest span where the record names it
        self.wrote_ends: dict[str, str] = {}  # a copied field -> the value the model wrote, its end to be read
        self.trims: dict[str, dict[str, Probe]] = {}  # a copied field -> {a word prefix of its value: its probe}
        self.starts = Starts()  # where a copied value that may not be null starts
        self._statements: list[Said] | None = None
        self._named: dict[str, flags.Reading] | None = None
        self._spans: list[str] | None = None
        self._ends = True  # read the copied values' ends (not on the references)
        self.ready = False  # the statement probes are built (the record's text tokenized)
        self._engine: EngineClient | None = None  # what the probes ran on (their results are read through it)

    def only(self, statements: list[Said], named: dict[str, flags.Reading], spans: Sequence[str] = ()) -> None:
        """Score only these (calibration: no copied value's end is read)."""
        self._statements, self._named, self._spans = statements, named, list(spans)
        self._ends = False

    async def prepare(self, engine: EngineClient) -> None:
        """Build the probes that read the record's text (statements, headings)."""
        self.ready, self._engine = True, engine
        if not self.text:
            return
        said = self.d._statements() if self._statements is None else self._statements
        named = {n: r for n, r in self.d.readings.items() if not r.described} if self._named is None else self._named
        spans = list(self.d.spans) if self._spans is None else self._spans
        probes: list[Probe] = []
        fits = engine.config.max_model_len
        for lead in dict.fromkeys([r.lead for r in said] + [self.d.spans[n][0] for n in spans]):
            ctx = await engine.tokenize(self.text + lead)
            for r in (r for r in said if r.lead == lead):
                probe = Probe.text(engine, ctx, r.text)
                if len(probe.prompt) + probe.params.max_tokens <= fits:
                    self.said[r] = probe  # else it does not fit: that reading is left out
                    probes.append(probe)
            for name in spans:
                label, branch = self.d.spans[name]
                if label != lead or len(ctx) + BEST_MAX_TOKENS > fits:
                    continue
                grammar = grounding.line_grammar(branch, self.sources, " ", LINE_END)
                if grammar is None:
                    continue
                self.line_nulls[name] = Probe.text(engine, ctx, " not given" + LINE_END)
                self.line_best[name] = Probe.best(ctx, grammar)
                probes += [self.line_nulls[name], self.line_best[name]]
                if self._ends and (close := near_grammar(self.text, self.sources, self.d.anchors[name], name, branch)):
                    self.line_near[name] = Probe.best(ctx, close)
                    probes.append(self.line_near[name])
        for name, lead in self.d.ends.items() if self._ends else ():
            ctx = await engine.tokenize(self.text + lead)
            grammar = grounding.line_grammar(self.d.branches[name], self.sources, " ", LINE_END)
            if grammar is not None and len(ctx) + BEST_MAX_TOKENS <= fits:
                probes.append(self.starts.search(name, ctx, grammar))
        if probes:
            self.waves += [probes[:1], probes[1:]]  # the first computes the text; the rest find it cached
        if named:
            body = list(engine.tokenizer(self.text, add_special_tokens=False)["input_ids"])
            heads = {n: await engine.tokenize(r.key) for n, r in named.items()}
            plain = await engine.tokenize(flags.PLAIN)
            if body and max(len(h) for h in [*heads.values(), plain]) + len(body) < engine.config.max_model_len:
                self.headings = {n: Probe.scored(h + body, len(body)) for n, h in heads.items()}
                self.headings[None] = Probe.scored(plain + body, len(body))
                self.waves.append(list(self.headings.values()))

    def add_context(self, engine: EngineClient, ctx: Context) -> None:
        """The record's value is generated: its null-or-present fields' probes, after each field's key, and the
        copied values whose end is read (their probes built by `pump`: tokenizing their line is awaited)."""
        fields = redo.top_fields(ctx.text)
        self.starts.written = {f.key: json.loads(ctx.text[f.start:f.end]) for f in fields or ()}  # each field's value
        ends: list[int] | None = None
        for f in fields or ():
            if f.key in self.d.ends and self.text and self._ends:
                value = self.starts.written[f.key]
                if isinstance(value, str) and 2 <= len(value.split()) <= MAX_END_WORDS:
                    self.wrote_ends[f.key] = value
                if isinstance(value, str):  # its context (for `starts`): the JSON up to its opening quote
                    ends = redo.token_ends(engine.tokenizer, ctx.token_ids) if ends is None else ends
                    self.starts.wrote(f.key, value, redo.ids_upto(engine.tokenizer, ctx, ends, f.start + 1))
        if not fields or not self.d.present:
            return
        ends = redo.token_ends(engine.tokenizer, ctx.token_ids) if ends is None else ends
        wave: list[Probe] = []
        for f in fields:
            closed = self.d.present.get(f.key)
            colon = ctx.text.rfind(":", 0, f.start)
            if closed is None or colon < 0 or closed.present is None:
                continue
            grammar = value_grammar(self.d.schema, closed.present, self.sources, ctx.text[colon + 1:f.start])
            if grammar is None:
                continue
            ids = redo.ids_upto(engine.tokenizer, ctx, ends, colon + 1)
            bridge = ctx.text[colon + 1:f.start]
            self.bridge[f.key] = bridge
            self.wrote[f.key] = self.starts.written[f.key]
            self.nulls[f.key] = Probe.text(engine, ids, bridge + "null")
            self.best[f.key] = Probe.best(ids, grammar)
            wave += [self.nulls[f.key], self.best[f.key]]
        self.now += wave

    async def pump(self, engine: EngineClient, mailbox: Callable[[], Mailbox], *, priority: int = 0,
                   cache_key: str | None = None) -> None:
        """Submit what may go now: the in-context probes, the start readings (after every submission: a search
        refused there is done, nothing left to wake this plan), and the next wave whose turn it is."""
        if self.wrote_ends and not self.trims:
            await self._read_ends(engine)
        while True:
            self.now += self.starts.build(engine, self.d.holds)
            if not (self.now or (self.waves and all(p.done for p in self.live))):
                return
            if self.now:
                wave, self.now = self.now, []
            else:
                wave = self.live = self.waves.pop(0)
            self.sent += wave
            for p in wave:
                await p.submit(engine, mailbox(), priority=priority, cache_key=cache_key)

    async def _read_ends(self, engine: EngineClient) -> None:
        for name, wrote in self.wrote_ends.items():
            cands = ends.candidates(self.text, wrote, functools.partial(self.d.holds, name),
                                    named=name in self.d.brands)
            if cands and (found := await ends.probes(engine, self.text, self.d.ends[name], cands)) is not None:
                self.trims[name] = found
                self.now += list(found.values())
        if not self.trims:
            self.wrote_ends = {}

    @property
    def done(self) -> bool:
        return self.ready and not (self.starts.waiting or self.waves or self.now) and all(p.done for p in self.sent)

    async def run(self, engine: EngineClient, *, priority: int = 0, cache_key: str | None = None) -> None:
        """All its probes, to the end (for one record alone, and for the references)."""
        import anyio

        from asyncpage.core.mailbox import Mailbox

        if not self.ready:
            await self.prepare(engine)
        wake = anyio.Event()

        def notify() -> None:
            wake.set()

        try:
            while True:
                await self.pump(engine, lambda: Mailbox(notify), priority=priority, cache_key=cache_key)
                if self.done:
                    return
                await wake.wait()
                wake = anyio.Event()
        except BaseException:
            self.abort(engine)
            raise

    def abort(self, engine: EngineClient) -> None:
        for p in self.sent:
            p.abort(engine)
        self.forget(engine)

    def forget(self, engine: EngineClient) -> None:
        """Drop the record's own grammars (its values' spans) from the engine's cache."""
        for p in [*self.nulls.values(), *self.best.values(), *self.line_nulls.values(), *self.line_best.values(),
                  *self.line_near.values(),
                  *(p for probes in self.trims.values() for p in probes.values()), *self.starts.probes()]:
            p.forget(engine)

    # ---- what the probes measured ---------------------------------------------------------------------------
    def _got(self, probe: Probe | None) -> Scored | None:
        return None if probe is None or self._engine is None else probe.result(self._engine)

    def statement_score(self, said: Said) -> float | None:
        got = self._got(self.said.get(said))
        return None if got is None else got.logprob

    def named_gain(self, name: str) -> float | None:
        own, plain = self._got(self.headings.get(name)), self._got(self.headings.get(None))
        return None if own is None or plain is None else (own.logprob - plain.logprob) / max(1, own.tokens)

    def margin(self, name: str) -> float | None:
        null, best = self._got(self.nulls.get(name)), self._got(self.best.get(name))
        return None if null is None or best is None else best.per_token - null.per_token

    def span_margin(self, name: str, near: bool = False) -> float | None:
        null, best = self._got(self.line_nulls.get(name)), self._got((self.line_near if near else self.line_best)
                                                                     .get(name))
        return None if null is None or best is None else best.logprob - null.logprob

    def _span_read(self, name: str, near: bool = False) -> tuple[float, float, float, str] | None:
        """A nullable copied field's span on its label line: (its margin, the offset, the margin it needs, it)."""
        m, off = self.span_margin(name, near), self.d.offsets.get(self.d.span_key(name))
        found = self._got((self.line_near if near else self.line_best).get(name))
        if m is None or off is None or found is None or not (value := found.text.strip()):
            return None
        whole = labeled_id(self.text, value, self.d.anchors[name])  # with the id's group its label holds
        value = whole if whole and self.d.holds(name, whole) else value
        return m, off, off + doubt(self.text, value, self.d.anchors[name], name, self.d.spans[name][1]), value

    def outcome(self, engine: EngineClient) -> tuple[dict[str, Any], dict[str, float]]:
        """(the decided values by field, each decision's share). Fields whose probes did not all run, or that
        have no offset, are left out (left to the model)."""
        self._engine = engine
        decided: dict[str, Any] = {}
        shares: dict[str, float] = {}
        for name, r in self.d.readings.items():
            g = self.statement_score(Said(*r.after)) if r.described else self.named_gain(name)
            if g is not None and r.key in self.d.offsets:  # true where it beats its offset or the record names it
                decided[name], shares[name] = r.decide(g - self.d.offsets[r.key], self.text)
        for name, opts in self.d.options.items():
            scores: dict[Said, float] = {}
            for said in opts:
                g, prior = self.statement_score(said), self.d.offsets.get(said.key)
                if g is not None and prior is not None:
                    scores[said] = g - prior
            if len(scores) == len(opts):
                top = max(scores.values())
                total = sum(math.exp(v - top) for v in scores.values())
                mix = {s: math.exp(v - top) / total for s, v in scores.items()}  # the model's shares
                said_named = scales.named(list(opts.values()), self.text, name) or [False] * len(opts)
                hits = dict(zip(opts, said_named, strict=True))
                n, strings = sum(hits.values()), sum(isinstance(o, str) for o in opts.values())
                if 0 < n < strings:  # an option the record names is copied (NAMED_WEIGHT); all named: no news
                    mix = {s: (1 - NAMED_WEIGHT) * p + NAMED_WEIGHT * hits[s] / n for s, p in mix.items()}
                # the likeliest the field's whole schema holds; on a tie (a share rounded away) a named one
                ranked = sorted(mix, key=lambda s: (mix[s], hits[s]), reverse=True)
                best = next((s for s in ranked if self.d.holds(name, opts[s])), None)
                if best is not None:
                    decided[name], shares[name] = opts[best], mix[best]
        for name, probes in self.trims.items():
            if (end := ends.outcome(probes, self._got)) is not None:
                decided[name], shares[name] = end
        for name in self.line_best:  # the likeliest span, or where the record names the field if it needs less
            if (read := self._span_read(name)) is None:
                continue
            gain, base, need, value = max(read, self._span_read(name, near=True) or read, key=lambda r: r[0] - r[2])
            shares[name] = logistic(abs(gain - need)) if need < math.inf else logistic(base - gain)  # no digit: model's
            decided[name] = value if gain > need else None
        for name in self.nulls:
            m, off = self.margin(name), self.d.margins.get(name)
            found = self._got(self.best.get(name))
            if m is None or off is None or found is None:
                continue
            shares[name] = logistic(abs(m - off))
            if m <= off:
                decided[name] = None
            elif self.wrote.get(name) is None:
                try:
                    decided[name] = json.loads(found.text[len(self.bridge[name]):])
                except ValueError:
                    shares.pop(name)
        for name, (span, share) in self.starts.outcome(self._got, decided, self.d.brands, self.text).items():
            decided[name], shares[name] = ends.name_of(span) if name in self.d.brands else span, share  # no noun
        decided |= ends.opened_brands(self.text, self.sources, self.d.brands, decided, self.starts.written,
                                      self.d.holds)
        d = self.d
        decided |= (rules := ruled(self.text, d.brands, d.branches, decided, self.starts.written, d.holds))
        shares = {n: v for n, v in shares.items() if n not in rules}  # a rule's values: no scored decision's share
        for name in [n for n, v in decided.items() if not self.d.holds(n, v)]:
            del decided[name]  # a span or a value its search found that the field's whole schema refuses
            shares.pop(name, None)
        return decided, shares
