"""Make the beam-search reference for the default model with transformers' own code, independent
of asyncpage: transformers loads the GGUF itself (~3 min here) and runs generate(num_beams=W,
do_sample=False) in float32. Output: tests/data/gemma3_270m_beams.json.

    .venv/bin/pip install -e ".[reference]"   # accelerate: transformers needs it to load a GGUF
    .venv/bin/python scripts/make_beam_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from make_reference import load_transformers  # scripts/ is on sys.path when this script runs

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma3_270m_beams.json"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Question: What is 17 multiplied by 3?\nAnswer:",
    "My favourite recipe for a quick dinner is",
    "The three laws of thermodynamics are",
]
# (beam_width, max_new_tokens, length_penalty, early_stopping) for every prompt, then variants on two.
SETTINGS = [(2, 32, 1.0, False), (4, 32, 1.0, False)]
VARIANTS = [(4, 24, 0.5, True), (3, 24, 2.0, "never"), (4, 24, -1.0, False)]


def main() -> None:
    path, tok, model = load_transformers()
    # "The tokenizer's and the generation config's EOS ids", as the beam search spec says.
    gen_eos = model.generation_config.eos_token_id
    gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
    eos = sorted({tok.eos_token_id, *gen_eos})
    cases = []
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok(prompt).input_ids])
        for w, n, lp, es in SETTINGS + (VARIANTS if i < 2 else []):
            with torch.no_grad():
                out = model.generate(ids, num_beams=w, num_return_sequences=w, do_sample=False, max_new_tokens=n,
                                     length_penalty=lp, early_stopping=es, eos_token_id=eos, pad_token_id=0,
                                     output_scores=True, return_dict_in_generate=True)
            beams = []
            for seq, score in zip(out.sequences, out.sequences_scores, strict=True):
                gen = seq[ids.shape[1]:].tolist()
                cut = next((j for j, t in enumerate(gen) if t in eos), len(gen))
                beams.append({"token_ids": gen[:cut], "score": float(score)})
            cases.append({"prompt": prompt, "beam_width": w, "max_tokens": n, "length_penalty": lp,
                          "early_stopping": es, "beams": beams})
            print(w, lp, es, repr(tok.decode(beams[0]["token_ids"])[:60]))
    OUT.write_text(json.dumps({"model": path.name, "dtype": "float32", "eos_token_ids": eos, "cases": cases},
                              indent=1, ensure_ascii=False))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
