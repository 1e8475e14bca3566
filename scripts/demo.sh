#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct, on the CPU, a few minutes):
#   1. the doctor on the drafter shipped with eyas: healthy;
#   2. the classic mistake on an exported copy (its layer ids count the embeddings as a layer),
#      which the doctor refuses, naming the fix;
#   3. speculative decoding against eyas plain decoding on MT-bench prompts;
#   4. a smoke run of the training path (prompts -> answers -> shards -> a drafter -> exports).
set -euo pipefail
cd "$(dirname "$0")/.."
EYAS=${EYAS:-.venv/bin/eyas}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/demo}
mkdir -p "$OUT"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "1/4 eyas doctor: does the shipped drafter see, served by eyas, the hidden states it was trained on?"
$EYAS doctor --target smollm2 --draft default --samples 16

say "2/4 the classic mistake: a vLLM export whose layer ids count the embedding layer as a block"
rm -rf "$OUT/drafter-vllm-broken"
$EYAS export default --to vllm --out "$OUT/drafter-vllm-broken" --json > /dev/null
# hidden_states[0] is the embeddings: ids written as indices into it land one block early
$PY - "$OUT/drafter-vllm-broken/config.json" <<'EOF'
import json, sys
path = sys.argv[1]
config = json.load(open(path))
config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
json.dump(config, open(path, "w"), indent=2)
print(f"{path}: eagle_aux_hidden_state_layer_ids -> {config['eagle_aux_hidden_state_layer_ids']}")
EOF
set +e
$EYAS doctor --target smollm2 --draft "$OUT/drafter-vllm-broken" --engine vllm --samples 16
code=$?
set -e
echo "(the doctor exited with code $code: it refuses the broken copy and says what to set)"

say "3/4 speculative decoding (a small tree: depth 2, top-2, 3 drafts) against eyas plain decoding, greedy, on MT-bench"
# Why so small a tree: on a 2-core CPU the target's products of up to 7 rows run transposed
# (eyas.engine.llama_kernels.linear), so verifying 4 tokens costs 1.2 to 1.5 plain steps, but 8 cost about
# 2.5 (a tree of 6 drafts verifies 7 tokens). Measured on 8 MT-bench prompts, 128 tokens, float32
# (eyas bench, one run each): tree 2,2,3 1.30x eyas plain (tau 1.81), 3,2,3 1.21x (tau 1.85); on 4
# prompts, 3,1,3 1.22x, 3,2,6 0.84x, chain 4 0.86x (benchmarks/results/2026-12-02-cpu-demo.md).
$EYAS bench --target smollm2 --draft default --prompts mt_bench --limit ${BENCH_PROMPTS:-4} \
  --max-new-tokens ${BENCH_TOKENS:-128} --tree 2,2,3 --device cpu --no-hf --png "$OUT/bench.png" --out "$OUT/bench.json"

say "4/4 smoke run of the training path (a few prompts, seconds of training: not a useful drafter)"
$EYAS regenerate --target smollm2 --prompts examples/prompts.jsonl --out "$OUT/answers.jsonl" \
  --limit ${TRAIN_PROMPTS:-16} --max-new-tokens 48 --batch-size 16
$EYAS capture --target smollm2 --data "$OUT/answers.jsonl" --out "$OUT/shards"
$EYAS train --target smollm2 --data "$OUT/shards" --out "$OUT/drafter" --steps ${STEPS:-20} \
  --batch-size 4 --draft-vocab 4096 --save-every 10 --eval-every 10
$EYAS info "$OUT/drafter"
$EYAS export "$OUT/drafter" --to sglang --out "$OUT/drafter-sglang"
$EYAS export "$OUT/drafter" --to vllm --out "$OUT/drafter-vllm"
echo "plots: $OUT/bench.png (accept lengths), $OUT/drafter/training.png (the smoke run)"
