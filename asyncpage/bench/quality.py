"""What quantization costs in quality: perplexity of a fixed text and greedy agreement with the
float32 reference, per setting (the settings of `asyncpage bench --settings`).

    python -m asyncpage.bench.quality                      # float32,bfloat16,gguf,gguf+kv=int8,gguf+kv=fp8
    python -m asyncpage.bench.quality --settings float32,gguf --reference tests/data/gemma3_270m_reference.json
    python -m asyncpage.bench.quality --model DIR --settings float32,int8,int4   # a float checkpoint quantized

Perplexity: the text below (written for this, ~900 tokens), teacher-forced in 256-token chunks that
continue their cached context (so a quantized KV pool is read as in serving). Decode perplexity: its
first 256 tokens teacher-forced one token a step, through the one-row decode path, whose kernels
differ from prefill's (a quantized layer's packed kernel, e.g. linear_q8 rounding its activations to
int8, where prefill's many rows take the dequantized copy). Agreement: greedy tokens
of the reference prompts (transformers, float32), one prompt at a time, counted up to each prompt's
first difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from asyncpage.bench.quant import parse_setting

# int8 / int4 change a float checkpoint's weights (--model DIR); a GGUF keeps its own blocks under them, as `gguf`.
DEFAULT_SETTINGS = "float32,bfloat16,gguf,gguf+kv=int8,gguf+kv=fp8"

TEXT = """\
The old harbour town wakes before the sun. Fishing boats leave in a line, their engines coughing in the
cold air, and the gulls follow them out past the breakwater. By the time the bakery opens its shutters,
the first crates of fish are already being carried up the stone steps to the market hall, where the
traders argue about prices in voices that carry across the square.

Most of the people who live here have done so for generations. Their grandparents mended nets on the
same benches, and their children will probably do the same, although fewer of them stay every year.
The school has lost two classes in a decade, and the ferry that once ran four times a day now runs
twice. Still, in summer the population doubles. Visitors come for the cliffs, the quiet beaches and the
seafood, and they leave with photographs of the lighthouse and sunburnt shoulders.

The lighthouse itself was built in 1872, after a storm drove three ships onto the rocks in a single
night. Its keeper lived in a small cottage at its foot, climbing the spiral staircase every evening to
light the lamp and every morning to put it out. The light has been automatic since 1981, but the
cottage is now a museum, and the curator, a retired teacher named Margaret, can tell you the name of
every keeper and most of their children.

A town like this depends on the weather more than on anything else. A week of storms means no fishing,
no visitors and no money, and the people plan their lives around the forecast the way farmers plan
around the seasons. When the wind turns to the north-east, the older fishermen say, it is time to
stay at home, check the roof and wait.

Science explains some of what the fishermen know by instinct. A north-easterly wind here blows across
hundreds of kilometres of open water, building waves that arrive at the harbour mouth with nothing to
slow them down. The shape of the bay focuses their energy onto the outer wall, and at high tide the
spray can reach the windows of the houses on the front. Engineers have proposed raising the wall by
two metres, but the cost is large and the town has argued about it for twenty years.

In the evenings, the square fills again. Children chase each other around the fountain, the cafe puts
out its tables, and someone usually brings a guitar. The conversations are about ordinary things: the
price of diesel, a wedding next month, whether the new council will finally repair the road to the
station. Nobody here expects the world to notice them, and most of them prefer it that way.

If you ask people what they would change about the town, many of them say nothing at all. Some want
better internet, a doctor who stays longer than two years, or a bus that runs on Sundays. A few talk
about the young people leaving and wonder who will run the boats in thirty years. But almost everyone
agrees that there are worse places to grow old than a harbour where the light still turns every night.

To cook the local fish stew, start with onions, garlic and fennel softened slowly in olive oil. Add
tomatoes, a glass of white wine and a pinch of saffron, then simmer for twenty minutes before adding
the fish in large pieces, the firmest first. Mussels go in at the end, with the lid on, until they
open. Serve it with bread that has been toasted and rubbed with garlic, and eat it outside if you can.
"""


def _prefill_nll(engine: Any, ids: list[int], chunk: int = 256) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:], teacher-forced through the engine's own KV pool."""
    from asyncpage.model.attention import AttentionMetadata, PrefillChunk

    runner = engine._core.runner
    bs = runner.block_size
    table = torch.arange(-(-len(ids) // bs))
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            end = min(start + chunk, len(ids) - 1)
            pos = torch.arange(start, end)
            meta = AttentionMetadata(block_size=bs, slot_mapping=pos.clone(), attention=runner.attention,
                                     prefills=[PrefillChunk(0, end - start, start, table[: -(-end // bs)])])
            hidden = runner.model(torch.tensor(ids[start:end]), pos, meta, runner.caches)
            logp = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
            target = torch.tensor(ids[start + 1 : end + 1])
            nll -= float(logp.gather(1, target[:, None]).sum())
            count += end - start
    return nll, count


DECODE_TOKENS = 256


def _decode_nll(engine: Any, ids: list[int], count: int = DECODE_TOKENS) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1 : count + 1], one decode step (one row) per token."""
    from asyncpage.core.runner import FlatBatch

    runner = engine._core.runner
    bs = runner.block_size
    n = min(count, len(ids) - 1)
    table = list(range(-(-(n + 1) // bs)))
    nll = 0.0
    with torch.inference_mode():
        for t in range(n):
            flat = FlatBatch(bs, runner.pad_slot, runner.device, runner.attention)
            flat.add([ids[t]], t, table)
            hidden = runner.model(*flat.build(), runner.caches)
            logp = torch.log_softmax(runner.model.compute_logits(hidden[:1]).float(), dim=-1)
            nll -= float(logp[0, ids[t + 1]])
    return nll, n


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy paths share before their first difference (all after it counts as
    different: a small model's path drifts at its first near-tie)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def _greedy(engine: Any, reference: dict[str, Any]) -> tuple[int, int, int]:
    from asyncpage import SamplingParams

    cases = reference["cases"]
    prompts = [c["prompt"] if c["prompt"] is not None else c["prompt_token_ids"] for c in cases]
    params = SamplingParams(max_tokens=reference["new_tokens"], temperature=0, ignore_eos=True)
    async with engine:
        # One prompt at a time: one-row decode steps, the kernels a one-stream app runs (a quantized
        # LM head's one-row path included: quant_kernels.w8a8_for), not those of a 9-row batch.
        outs = [await engine.generate(p, params) for p in prompts]
    agree = whole = 0
    for o, c in zip(outs, cases, strict=True):
        n = agreeing_prefix(o.token_ids, c["greedy_token_ids"])
        agree += n
        whole += n == len(c["greedy_token_ids"])
    return agree, sum(len(c["greedy_token_ids"]) for c in cases), whole


def main(argv: list[str] | None = None) -> int:
    from asyncpage import AsyncEngine

    ap = argparse.ArgumentParser(prog="python -m asyncpage.bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--settings", default=DEFAULT_SETTINGS)
    ap.add_argument("--reference", default=str(Path(__file__).parents[1] / "tests/data/gemma3_270m_reference.json"),
                    help="greedy reference tokens (scripts/make_reference.py); skipped if the file is missing")
    args = ap.parse_args(argv)
    reference = json.loads(Path(args.reference).read_text()) if Path(args.reference).exists() else None
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    loaded: dict[tuple[str, str | None, bool | None], Any] = {}
    rows = []
    for s in settings:
        o = parse_setting(s)
        key = (o["dtype"], o["quantization"], o.get("compile"))
        if key not in loaded:
            loaded.clear()  # one set of weights at a time
            # +compile: the decode perplexity and greedy tokens then come from the compiled decode steps
            loaded[key] = AsyncEngine.from_pretrained(args.model, dtype=o["dtype"], quantization=o["quantization"],
                                                      compile=o.get("compile"), max_num_batched_tokens=256)
        base = loaded[key]
        engine = base if o["kv_cache_dtype"] == "auto" else base.clone(kv_cache_dtype=o["kv_cache_dtype"])
        ids = engine.tokenizer(TEXT)["input_ids"]
        nll, n = engine.compute.run(_prefill_nll, engine, ids)
        ppl = math.exp(nll / n)
        dnll, dn = engine.compute.run(_decode_nll, engine, ids)
        dppl = math.exp(dnll / dn)
        greedy = asyncio.run(_greedy(engine, reference)) if reference else None
        rows.append((s, engine.config.dtype, ppl, dppl, greedy))
        g = f"{greedy[0]}/{greedy[1]} tokens, {greedy[2]}/9 prompts whole" if greedy else "-"
        print(f"{s:<18} [{engine.config.dtype}, KV {engine.config.kv_cache_dtype}] perplexity {ppl:.3f} ({n} "
              f"tokens), decode perplexity {dppl:.3f} ({dn} tokens one a step); greedy agreement with float32 {g}",
              flush=True)
    base_ppl, base_dppl = rows[0][2], rows[0][3]
    vs = "vs " + settings[0]
    print(f"\n{'setting':<18} {'perplexity':>10} {vs:>14} {'decode ppl':>10} {vs:>14} {'greedy agreement':>18}")
    for s, _, ppl, dppl, greedy in rows:
        g = f"{greedy[0]}/{greedy[1]} ({greedy[2]}/9)" if greedy else "-"
        print(f"{s:<18} {ppl:10.3f} {100 * (ppl / base_ppl - 1):+13.2f}% {dppl:10.3f}"
              f" {100 * (dppl / base_dppl - 1):+13.2f}% {g:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
