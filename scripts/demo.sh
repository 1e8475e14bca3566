#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct, CPU, a few minutes):
# prompts -> the target's own answers -> hidden-state shards -> a briefly trained drafter ->
# its contract and the boundaries each engine would capture -> SGLang and vLLM exports.
set -euo pipefail
cd "$(dirname "$0")/.."
EYAS=${EYAS:-.venv/bin/eyas}
OUT=${OUT:-runs/demo}
mkdir -p "$OUT"
$EYAS regenerate --target smollm2 --prompts examples/prompts.jsonl --out "$OUT/answers.jsonl" \
  --max-new-tokens 128 --batch-size 16
$EYAS capture --target smollm2 --data "$OUT/answers.jsonl" --out "$OUT/shards"
$EYAS train --target smollm2 --data "$OUT/shards" --out "$OUT/drafter" --steps ${STEPS:-60} \
  --batch-size 4 --draft-vocab 4096 --save-every 30 --eval-every 30
$EYAS info "$OUT/drafter"
$EYAS export "$OUT/drafter" --to sglang --out "$OUT/drafter-sglang"
$EYAS export "$OUT/drafter" --to vllm --out "$OUT/drafter-vllm"
$EYAS info "$OUT/drafter-vllm"
echo "plot of the training run: $OUT/drafter/training.png"
