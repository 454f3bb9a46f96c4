#!/usr/bin/env bash
# Every figure in the README, one after the other (never two heavy runs at once on 2 cores).
# Takes ~25 minutes here. Figures vary ~10-20% from run to run on this (shared) machine.
set -euo pipefail
cd "$(dirname "$0")/.."
A=.venv/bin/asyncpage
for dt in float32 bfloat16; do
  $A bench --workload single -n 1 --dtype $dt
  $A bench --workload mixed -n 16 --dtype $dt
done
$A bench --workload mixed -n 32 --dtype bfloat16 --baseline transformers
$A bench --workload mixed -n 32 --dtype float32 --baseline transformers
$A bench-sharing --dtype bfloat16
$A bench-eviction
$A bench-guided --data ../shared/data --dtype bfloat16
$A bench --workload mixed --dtype bfloat16 --sweep 1,4,16,64 --plot docs/concurrency.png
$A bench --dtype float32 --speculative ngram:8
$A bench --workload single --settings float32,bfloat16,int8,int4,int4+kv=int8
.venv/bin/python -m asyncpage.bench.quality
.venv/bin/python -m pytest -q -s tests/test_beam_search.py -k long_prompt
