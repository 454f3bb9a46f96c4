"""Decoding: one step's logits to tokens and one sequence's tokens to text. Sampling and seeded
generators (sampling.py), the grammar step shared by the runner and verification (guided_step.py),
n-gram speculation and verification (speculative.py), beam rules (beam.py), the incremental
detokenizer and beam stop strings (detokenizer.py). Never imports core/ or model/."""
