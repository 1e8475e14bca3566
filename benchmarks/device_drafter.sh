#!/usr/bin/env bash
# A drafter run on the lent GPU machine, in few calls (each call: `bash benchmarks/device_drafter.sh STEP`).
# The machine goes cold about 30 s after a call and keeps nothing then; $OUT returns at most 8 files
# of 16 MiB; the SmolLM2 GGUF (98 MB) travels in two parts, one per call (carry .device/gguf/smol.part00
# in the first call, .device/gguf/smol.part01 in the next; carry .device/wheels and benchmarks/data in
# every call, and .device/old_src.tar.gz -- `git archive <old commit> src | gzip` -- for a before stage).
#
#   setup        install the py3.12 wheels (gguf, pydantic) into /tmp/deps, keep the GGUF's first part,
#                unpack the old src (if carried)
#   start ARGS   join the GGUF (sha256 checked), start train_smollm2_drafter.py run ARGS in the
#                background (its log: /tmp/drafter/run.log), then wait like `wait`
#   wait [S]     wait up to S seconds (default 540) for the run to end, print the log's last lines
#                (AFTER=cmd with start/train: run cmd in the same background job once the run, and its
#                evaluation, are done and collectable: e.g. `bash benchmarks/device_serve.sh rows`, no call between)
#   train ARGS   `start ARGS`, then in the same background job `evaluate` (so no call waits between them); `wait`
#                returns, once both are done, the drafter and run.tar (`collect`) and doc_requests.jsonl.gz in $OUT
#   evaluate     issue 34's bars: `eyas bench` on the six sets (mt_bench humaneval gsm8k alpaca sum qa), tree
#                4,8,15, temperatures 0 and 1, EVAL_LIMIT prompts a set (24), the drafter trained and the shipped one
#   collect      the drafter (bf16 shards + a tar of its small files), the summary and the logs into $OUT
#   requests     where a real request's time goes (round_cost_gpu.py --prompt-set mt_bench, the GC as is and frozen),
#                with SmolLM2's weights and randomised (after setup and part; carry the GGUF's last part)
#   experiments  issue 10's 8B bar in one call, no GGUF: the split-KV kernels' tests on the GPU, then the 8B-shaped
#                step with split-KV / SDPA attention, gemm and reduce-tuned (llama_8b_cost.py; VARIANTS=...)
#   matvec       issue 10's 8B bar with matvec='triton': the kernels' tests on the GPU, the products per tiling
#                (matvec_gpu.py; SHAPES=8b,smollm2, TILINGS=...), the best written to $OUT/tilings.json, then the
#                8B-shaped step with them (VARIANTS=...; STEP_S=220 its time limit)
#   confirm      matvec='triton' with the shipped tilings: the 8B- and SmolLM2-shaped steps, the engine's GPU tests
#   rows         the few-row kernel (verification through eyas' kernels): the kernels' tests on the GPU, then the 8B- and
#                SmolLM2-shaped steps, the default (auto) against cuBLAS + eager and triton + eager (llama_8b_cost.py),
#                then with GREEDY=expr the engine's GPU tests that -k expr selects (GREEDY_S: their time limit)
#   fewrows      the few-row kernel's tilings per product at 32 and 16 rows (matvec_gpu.py --rows, SmolLM2 and its
#                drafter), the best into $OUT/rows_tilings.json, then the SmolLM2-shaped step by rule and with them
#   probe ARGS   spec ARGS, then topk, then the GPU tests of the warmed draft state and of float32 identity with
#                triton-verify, in one call (after setup and part; carry the GGUF's last part; COMMIT=sha)
#   roundab      a round's cost in plain steps, no GGUF: the old src (.device/old_src.tar.gz) against src, one process
#                each (round_cost_gpu.py; LABELS, TREES, TAUS, RC_S), then the GPU tests -k TESTS (if set)
#   topk         the drafter's per-depth selection alone: torch.topk against stable sorts, eager and compiled
#                (draft_topk_gpu.py --compile; no GGUF, after setup)
#   tiling       one block's attention alone, eager against the split-KV kernels per tiling (decode_attention_gpu.py)
#   gputests     the engine's GPU tests, then the matvec='reduce' identity test run for its message
#   attention    the shipped drafter with the fast target's attention eager, then split-kv (Triton): spec_gpu.py twice
#   rounds       the shipped drafter on SmolLM2 with verification and drafting through eyas' kernels (--matvec
#                triton-verify --attention split-kv, its auto; HF compiled beside it), then with cuBLAS verification
#                (--matvec triton): spec_gpu.py twice (after setup and part, like kernels; COMMIT=sha)
#   kernels      the shipped drafter on SmolLM2, cuBLAS and eager attention (--matvec gemm --attention eager), then
#                the default (auto: eyas' Triton kernels on a GPU): spec_gpu.py twice (after setup and part, like
#                attention; COMMIT=sha)
#   compare      the drafter just trained against the shipped one: spec_gpu.py on MT-bench, temperature 0, same
#                prompts and trees, HF generate compiled beside the new one ($OUT/compare.tar, compare.log)
#   bench [ARGS] benchmarks/spec_gpu.py on MT-bench with the drafter, results into $OUT/spec (COMMIT=sha)
#   grow ARGS    issue 34's staged first step: start with --stop-after mix (eyas prompts writes Magpie turns and
#                requests about the open sets' documents, then the mix; --grown benchmarks/grown starts from what
#                earlier sessions grew); carry the GGUF's last part (the five-part split .device/g5/smol.p0..p4:
#                p0 and .device/wheels with setup, p1 and .device/data.tgz with part, p2 with part, p3 with part,
#                .device/open/files.tar.xz alone with part: the open sets' pinned files, from which keep_parts builds
#                /tmp/open/open.jsonl and docs.jsonl), then `wait`: once done, $OUT gets magpie.jsonl.gz,
#                doc_requests.jsonl.gz and summary.json (commit them into benchmarks/grown)
#   part         keep the GGUF parts carried in this call (a three-part split, .device/g3/smol.p0..p2, for
#                calls whose work tree is larger: carry p0 with setup, p1 with `part`, p2 with `measure`),
#                and unpack .device/data.tgz (`tar czf .device/data.tgz -C benchmarks/data .`: the prompt
#                mix, 1.6 MB rather than 6) into /tmp/data: `start --prompts /tmp/data/train_prompts.jsonl
#                --val-prompts /tmp/data/val_prompts.jsonl`
#   spec [ARGS]  join the GGUF, then benchmarks/spec_gpu.py with the shipped drafter and ARGS, results and
#                its log into $OUT (spec.tar, spec.log); carry the GGUF's last part (COMMIT=sha)
#   measure      join the GGUF, then in order of importance, each result into $OUT as it is done (a
#                call cut by the time limit still returns what finished): MT-bench with the shipped
#                drafter compiled (spec_on.tar), eyas serve under load (serve.json), regeneration of 1,024
#                prompts with its summary (regen.json), MT-bench with the drafter's steps eager (spec_off.tar);
#                carry benchmarks/data/regen_1024.jsonl (`head -1024 benchmarks/data/train_prompts.jsonl`):
#                the tree with the shipped drafter (27 MB) and a third of the GGUF leave little room
#
# Split in three: `split -n 3 -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf .device/g3/smol.p` (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WORK=benchmarks/out/smollm2
LOG=/tmp/drafter/run.log
export PYTHONPATH=src:/tmp/deps TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=30
mkdir -p /tmp/drafter

keep_parts() {  # the GGUF parts (and the prompt mix, .device/data.tgz; the open sets, .device/open/*.jsonl.gz)
  # carried in this call, kept in /tmp
  for f in .device/gguf/smol.part0* .device/g[0-9]/smol.p*; do [ -f "$f" ] && cp "$f" /tmp/; done
  if [ -f .device/data.tgz ]; then mkdir -p /tmp/data && tar xzf .device/data.tgz -C /tmp/data && ls /tmp/data; fi
  # an earlier session's drafter (a staged run's --init-from /tmp/prev), whole or a file a call
  if [ -d .device/prev ]; then mkdir -p /tmp/prev && cp -r .device/prev/. /tmp/prev/ && ls /tmp/prev; fi
  for f in .device/open/*.jsonl.gz; do
    [ -f "$f" ] && mkdir -p /tmp/open && gunzip -c "$f" > "/tmp/open/$(basename "$f" .gz)" && echo "kept $f"
  done
  # the open sets' pinned files (`tar cJf .device/open/files.tar.xz -C .device/open files`, 20 MB rather than the
  # prompts' 100+): eyas open-prompts builds /tmp/open/open.jsonl and docs.jsonl from them here (no network)
  if [ -f .device/open/files.tar.xz ]; then
    mkdir -p /tmp/open && python -c "import tarfile; tarfile.open('.device/open/files.tar.xz').extractall('/tmp/open')"
    python -m eyas.cli.main open-prompts --files /tmp/open/files --out /tmp/open/open.jsonl \
      --documents-out /tmp/open/docs.jsonl --json > /tmp/open/report.json && grep -E '"(written|documents)"' /tmp/open/report.json
  fi; true
}

join_gguf() {  # /tmp/smol.gguf from the parts kept (two-part or three-part split), sha256 checked
  if [ ! -f /tmp/smol.gguf ]; then
    if [ -f /tmp/smol.p0 ]; then cat /tmp/smol.p[0-9] > /tmp/smol.gguf  # a 3-, 4- or 5-part split, in order
    else cat /tmp/smol.part00 /tmp/smol.part01 > /tmp/smol.gguf; fi
  fi
  echo "$SHA  /tmp/smol.gguf" | sha256sum -c -
}

spec_pair() {  # NAME LABEL_A "ARGS_A" LABEL_B "ARGS_B" [spec_gpu.py ARGS]
  # the shipped drafter on SmolLM2, MT-bench at temperature 0, with the fast target built with ARGS_A, then with
  # ARGS_B: one process each, the same prompts and trees; HF generate compiled beside A. Results:
  # $OUT/NAME.tar (/tmp/NAME/LABEL_*), NAME.log; carry the GGUF's last part (COMMIT=sha)
  local name=$1 label_a=$2 args_a=$3 label_b=$4 args_b=$5 side label args skip
  shift 5
  keep_parts
  join_gguf
  local C=${COMMIT:?set COMMIT to the commit whose tree was sent}
  for side in a b; do
    label=$label_a args=$args_a skip=hf_eager
    [ "$side" = b ] && label=$label_b args=$args_b skip=hf_eager,hf_compiled
    # shellcheck disable=SC2086  # args: several options
    timeout "${SPEC_S:-262}" python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft src/eyas/interop/embedded/smollm2-135m-instruct \
      --out-dir "/tmp/$name/$label" --commit "$C" $args --sets mt_bench --prompts-per-set 24 \
      --temperatures 0 --trees 6,10,60 4,8,24 --chains 4 --select-prompts 4 --skip "$skip" --no-tree-auto \
      --budget-s $(( ${SPEC_S:-262} - 27 )) "$@" >> "$OUT/$name.log" 2>&1 || echo "$name $label exit $?" >> "$OUT/$name.log"
  done
  (cd /tmp && tar cf "$OUT/$name.tar" "$name") || true
  tail -n 40 "$OUT/$name.log"
}

step_cost() {  # NAME SHAPE VARIANTS LIMIT_S: llama_8b_cost.py --profile (8b or smollm2) into $OUT/NAME.json, .log
  (cd benchmarks && PYTHONPATH=$PWD/../src:/tmp/deps timeout "$4" python llama_8b_cost.py --shape "$2" --profile \
    --variants "$3" --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1) || echo "$1 exit $?" >> "$OUT/$1.log"
  tail -n 16 "$OUT/$1.log"
}

kernel_tests() {  # LIMIT_S: the Triton kernels' tests compiled on the GPU (the slow greedy walks left out)
  timeout "$1" python -m pytest -q -p no:cacheprovider tests/test_matvec.py tests/test_draft_kernels.py \
    tests/test_decode_attention.py -k "not greedy" > "$OUT/kernel_tests.log" 2>&1 || true
  tail -n 3 "$OUT/kernel_tests.log"
}

wait_run() {  # and once it is done, what a staged run left for the next session (grow) into $OUT; after
  # `train`, wait for its evaluation too, then collect the drafter, its evaluation and the requests that grew
  local limit=${1:-540} t=0 done=/tmp/drafter/DONE
  [ -f /tmp/drafter/EVAL_WANTED ] && done=/tmp/drafter/FINISHED
  while [ ! -f "$done" ] && [ "$t" -lt "$limit" ]; do sleep 10; t=$((t + 10)); done
  [ -f "$done" ] && echo "run finished: $(cat /tmp/drafter/DONE)" || echo "still running after ${t} s"
  if [ -f "$done" ] && [ "$done" = /tmp/drafter/FINISHED ]; then
    [ -f "$WORK/doc_requests.jsonl.gz" ] && cp "$WORK/doc_requests.jsonl.gz" "$OUT/"
    if [ -d "$WORK/drafter" ]; then collect; else (cd /tmp/drafter && tar cf "$OUT/run.tar" eval) || true; fi
  elif [ -f "$done" ]; then
    for f in "$WORK"/*.jsonl.gz "$WORK/summary.json"; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  fi
  tr '\r' '\n' < "$LOG" | grep -av "it/s\]$\|s/it\]$" | tail -n 40
  for f in /tmp/drafter/eval/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 14 "$f"; }; done; true
}

collect() {  # the drafter (bf16 shards + a tar of its small files) and run.tar (the summary, the log, the evaluation)
  # into $OUT: $OUT returns 8 files, and a whole-vocabulary drafter is 5 shards
  python - <<'PY'
import sys, pathlib as p
sys.path.insert(0, "benchmarks")
import train_smollm2_drafter as t
print(t.transport_copy(p.Path("benchmarks/out/smollm2/drafter"), p.Path("/tmp/drafter/bf16")))
PY
  cp /tmp/drafter/bf16/*.safetensors "$OUT/"
  (cd /tmp/drafter/bf16 && tar cf "$OUT/drafter_meta.tar" --exclude='*.safetensors' .)
  cp "$WORK/summary.json" /tmp/drafter/train_summary.json
  tr '\r' '\n' < "$LOG" | grep -av "it/s\]$\|s/it\]$" > /tmp/drafter/run.log
  (cd /tmp/drafter && tar cf "$OUT/run.tar" train_summary.json run.log $([ -d eval ] && echo eval))
  ls -la "$OUT"
}

evaluate() {  # issue 34's bars: the six EAGLE sets, tree 4,8,15, temperatures 0 and 1, EVAL_LIMIT prompts a set
  # (default 24), 128 new tokens: the drafter just trained, then the shipped one (EVAL_DRAFTERS="new" leaves it out:
  # tau and acceptance do not depend on the machine's noise, so an earlier session's figures stand), one process each
  local d=/tmp/drafter/eval name dir
  mkdir -p "$d"
  for name in ${EVAL_DRAFTERS:-new shipped}; do
    dir=$WORK/drafter
    [ "$name" = shipped ] && dir=src/eyas/interop/embedded/smollm2-135m-instruct
    [ -d "$dir" ] || continue
    timeout "${EVAL_S:-420}" python -m eyas.cli.main bench --target /tmp/smol.gguf --draft "$dir" \
      --prompts mt_bench --prompts humaneval --prompts gsm8k --prompts alpaca --prompts sum --prompts qa \
      --temperatures 0,1 --max-new-tokens 128 --limit "${EVAL_LIMIT:-24}" --tree 4,8,15 --no-hf \
      --out "$d/$name.json" --png "$d/$name.png" > "$d/$name.log" 2>&1 || echo "bench exit $?" >> "$d/$name.log"
  done
}

case "${1:-}" in
  setup)
    pip install -q --no-index --no-deps --target /tmp/deps .device/wheels/*.whl 2>&1 | grep -v "root user" || true
    keep_parts
    if [ -f .device/old_src.tar.gz ]; then mkdir -p /tmp/old && tar xzf .device/old_src.tar.gz -C /tmp/old; fi
    python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
    ;;
  start|train)
    stage=$1
    shift
    keep_parts
    join_gguf
    rm -f /tmp/drafter/DONE /tmp/drafter/FINISHED /tmp/drafter/EVAL_WANTED
    then=true
    [ "$stage" = train ] && touch /tmp/drafter/EVAL_WANTED && then="bash benchmarks/device_drafter.sh evaluate"
    setsid nohup bash -c "python benchmarks/train_smollm2_drafter.py run --target /tmp/smol.gguf --no-copy-to-out $* \
      > $LOG 2>&1; echo \"exit \$?\" > /tmp/drafter/DONE; $then; touch /tmp/drafter/FINISHED; ${AFTER:-true}" \
      > /dev/null 2>&1 &
    wait_run 530
    ;;
  grow)
    shift
    keep_parts
    join_gguf
    rm -f /tmp/drafter/DONE /tmp/drafter/EVAL_WANTED
    setsid nohup bash -c "python benchmarks/train_smollm2_drafter.py run --target /tmp/smol.gguf --stop-after mix $* \
      > $LOG 2>&1; echo \"exit \$?\" > /tmp/drafter/DONE" > /dev/null 2>&1 &
    wait_run 530
    ;;
  wait)
    wait_run "${2:-540}"
    ;;
  collect)
    collect
    ;;
  evaluate)
    evaluate
    ;;
  bench)
    shift
    python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft "$WORK/drafter" --out-dir "$OUT/spec" \
      --commit "${COMMIT:?set COMMIT to the commit whose tree was sent (the machine has a stale .git)}" \
      --sets mt_bench --prompts-per-set 24 --temperatures 0 --trees 6,10,60 8,8,48 6,16,80 --chains 4 6 \
      --select-prompts 6 --budget-s 390 "$@"
    ;;
  part)
    keep_parts
    ls -la /tmp/smol.p* /tmp/smol.part* 2>/dev/null || true
    ;;
  spec)
    shift
    keep_parts
    join_gguf
    timeout 560 python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft src/eyas/interop/embedded/smollm2-135m-instruct \
      --out-dir /tmp/spec --commit "${COMMIT:?set COMMIT to the commit whose tree was sent}" "$@" > "$OUT/spec.log" 2>&1 \
      || echo "spec_gpu exit $?" >> "$OUT/spec.log"
    (cd /tmp && tar cf "$OUT/spec.tar" spec) || true
    tail -n 30 "$OUT/spec.log"
    ;;
  measure)
    keep_parts
    join_gguf
    D=src/eyas/interop/embedded/smollm2-135m-instruct
    C=${COMMIT:?set COMMIT to the commit whose tree was sent}
    timeout 230 python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft $D --out-dir /tmp/spec_on --commit "$C" \
      --sets mt_bench --prompts-per-set 24 --temperatures 0 --trees 8,8,48 6,16,80 6,10,60 --chains 4 6 \
      --select-prompts 4 --budget-s 180 > "$OUT/measure.log" 2>&1 || echo "spec_on exit $?" >> "$OUT/measure.log"
    (cd /tmp && tar cf "$OUT/spec_on.tar" spec_on) || true
    timeout 100 python benchmarks/serve_load.py --target /tmp/smol.gguf --draft $D --tree 8,8,48 \
      --clients 1,4,16 --requests 2 --max-tokens 64 --json > "$OUT/serve.json" 2>> "$OUT/measure.log" \
      || echo "serve exit $?" >> "$OUT/measure.log"
    timeout 110 python -m eyas.cli.main regenerate --target /tmp/smol.gguf --prompts benchmarks/data/regen_1024.jsonl \
      --out /tmp/regen/answers.jsonl --limit 1024 --max-new-tokens 256 --batch-size 512 --temperatures 0 \
      --max-prompt-tokens 768 --max-turns 2 --loops cut --cache auto --device cuda --json > "$OUT/regen.json" 2>> "$OUT/measure.log" \
      || echo "regen exit $?" >> "$OUT/measure.log"
    timeout 80 python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft $D --out-dir /tmp/spec_off --commit "$C" \
      --sets mt_bench --prompts-per-set 8 --temperatures 0 --trees 8,8,48 --chains 4 --select-prompts 1 \
      --skip hf_compiled,hf_eager --drafter-compile off --no-profile --budget-s 60 >> "$OUT/measure.log" 2>&1 \
      || echo "spec_off exit $?" >> "$OUT/measure.log"
    (cd /tmp && tar cf "$OUT/spec_off.tar" spec_off) || true
    ls -la "$OUT"
    ;;
  requests)
    # where a real request's time goes: MT-bench through plain and each tree, the garbage collector as it is and
    # frozen, with SmolLM2's weights, then the same randomised (round_cost_gpu.py --prompt-set; after setup and
    # part, carry the GGUF's last part; TREES, WEIGHTS='real random', EXTRA: more options, REQ_S: each run's limit)
    keep_parts
    join_gguf
    for w in ${WEIGHTS:-real random}; do
      extra=""
      [ "$w" = random ] && extra="--random-weights"
      # shellcheck disable=SC2086
      timeout "${REQ_S:-200}" python benchmarks/round_cost_gpu.py --target /tmp/smol.gguf --prompt-set mt_bench \
        --prompts 24 --trees ${TREES:-4,8,15} --matvec triton-verify --attention split-kv --gc default freeze \
        --requests-only --label "$w" $extra ${EXTRA:-} --out "$OUT/requests_$w.json" > "$OUT/requests_$w.log" 2>&1 \
        || echo "requests $w exit $?" >> "$OUT/requests_$w.log"
      tail -n 12 "$OUT/requests_$w.log"
    done
    ;;
  experiments)
    # issue 10's 8B bar, one call, no GGUF: the split-KV kernels' tests compiled on the GPU, then the 8B-shaped
    # step with split-KV attention against the eager order (gemm and reduce-tuned) and SDPA
    kernel_tests 120
    step_cost 8b 8b "${VARIANTS:-compiled-split-kv,compiled-reduce-tuned-split-kv,compiled-reduce-tuned,compiled,compiled-sdpa}" 440
    ;;
  matvec)
    # issue 10's 8B bar with eyas.engine.matvec (matvec='triton'): the Triton kernels' tests compiled on the GPU,
    # the 8B products per tiling (matvec_gpu.py, the best of each written to $OUT/tilings.json), then the
    # 8B-shaped step with those tilings (llama_8b_cost.py; VARIANTS=...)
    kernel_tests 120
    T=1/1024/4,1/2048/4,1/2048/8,2/1024/4,2/1024/8,2/2048/4,2/2048/8,4/1024/4,4/1024/8,4/2048/8,8/512/4,8/1024/4
    T=$T,8/1024/8,16/1024/4,16/1024/8,1/4096/8
    TILINGS=${TILINGS:-$(echo "$T" | tr ',' '\n' | sed 's|$|/1|;p;s|/1$|/0|' | paste -sd,)}
    timeout ${MATVEC_S:-200} python benchmarks/matvec_gpu.py --shapes "${SHAPES:-8b}" --tilings "$TILINGS" \
      --out "$OUT/matvec.json" --write-tilings "$OUT/tilings.json" > "$OUT/matvec.log" 2>&1 \
      || echo "matvec exit $?" >> "$OUT/matvec.log"
    grep -E "floor|exit" "$OUT/matvec.log" | tail -n 12
    EYAS_MATVEC_TILINGS="$OUT/tilings.json" step_cost 8b 8b "${VARIANTS:-compiled-triton-split-kv,compiled}" "${STEP_S:-220}"
    ;;
  confirm)
    # matvec='triton' with the shipped tilings on another machine, in order of importance: the 8B-shaped step, the
    # SmolLM2-shaped one (llama_8b_cost.py), then the engine's GPU tests (greedy identity with every option)
    step_cost 8b 8b "${VARIANTS:-compiled-triton-split-kv,compiled}" "${STEP_S:-150}"
    step_cost smollm2 smollm2 compiled-triton-split-kv,compiled "${SMOL_S:-100}"
    timeout ${TESTS_S:-200} python -m pytest -v -p no:cacheprovider tests/test_engine_cuda.py tests/test_engine_llama.py \
      -k 'cuda or gpu' > "$OUT/gpu_tests.log" 2>&1 || true
    grep -E "PASSED|FAILED|ERROR|XFAIL|XPASS|passed|failed" "$OUT/gpu_tests.log" | tail -n 30
    ;;
  rows)
    # the Triton kernels for every fixed-shape step (one row and a few): their tests compiled on the GPU, then the
    # 8B-shaped step and verification, then the SmolLM2-shaped ones (llama_8b_cost.py), each result into $OUT as done
    kernel_tests "${TESTS_S:-120}"
    step_cost 8b 8b "${VARIANTS:-compiled-triton-split-kv,compiled,compiled-triton}" "${STEP_S:-250}"
    step_cost smollm2 smollm2 "${SMOL_VARIANTS:-compiled-triton-split-kv,compiled}" "${SMOL_S:-120}"
    if [ -n "${GREEDY:-}" ]; then  # the float32 greedy identity tests of these options (-k GREEDY)
      timeout "${GREEDY_S:-100}" python -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py -k "$GREEDY" \
        > "$OUT/greedy.log" 2>&1 || true
      tail -n 5 "$OUT/greedy.log"
    fi
    ;;
  fewrows)
    # the few-row kernel per product and tiling (matvec_gpu.py --rows: 32, a tree of 31 nodes and its root; 16, a tree
    # of 15 and the drafter's frontier), the best of each written to $OUT/rows_tilings.json; then the SmolLM2-shaped
    # step by rows_tiling's rule and with that table (llama_8b_cost.py --profile). No GGUF; after setup
    for r in 32 16; do
      shapes=smollm2; [ "$r" = 16 ] && shapes=smollm2,smollm2_drafter
      timeout "${GRID_S:-200}" python benchmarks/matvec_gpu.py --shapes "$shapes" --rows "$r" --min-bytes $((100 << 20)) \
        --products "${PRODUCTS:-qkv,o,gate_up_glu,down_glu,head,fc}" --block-n "${BLOCK_N:-16,32,64,128}" --block-k "${BLOCK_K:-128,256,512}" \
        --warps "${WARPS:-4,8}" --write-tilings "$OUT/rows_tilings.json" --out "$OUT/rows$r.json" > "$OUT/rows$r.log" 2>&1 \
        || echo "rows $r exit $?" >> "$OUT/rows$r.log"
      grep -E "best|exit" "$OUT/rows$r.log" | tail -n 12
    done
    step_cost smollm2_rule smollm2 compiled-triton-verify-split-kv "${SMOL_S:-100}"
    EYAS_MATVEC_TILINGS=$OUT/rows_tilings.json step_cost smollm2_table smollm2 compiled-triton-verify-split-kv "${SMOL_S:-100}"
    ;;
  probe)
    shift
    # one call after setup and part (carry the GGUF's last part; COMMIT=sha): spec ARGS (its profile splits the GPU's idle
    # time), then topk, then the GPU tests of the warmed draft state and of float32 identity through the kernels
    bash "$0" spec "$@"
    bash "$0" topk
    timeout "${TESTS_S:-200}" python -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py \
      -k "warmed or triton-verify" > "$OUT/gpu_tests.log" 2>&1 || true
    tail -n 5 "$OUT/gpu_tests.log"
    ;;
  roundab)
    # a round's cost in plain steps with no GGUF (round_cost_gpu.py: random SmolLM2-shaped target, the shipped
    # drafter), the old src (carry .device/old_src.tar.gz: `git archive SHA src ':(exclude)src/eyas/interop/embedded'
    # | gzip`) against src, one process each, in the order of LABELS (default "before after"; a label starting with
    # "before" runs the old src); each profiles one round. Then the GPU tests that -k TESTS selects (if set).
    pip install -q --no-index --no-deps --target /tmp/deps .device/wheels/*.whl 2>&1 | grep -v "root user" || true
    mkdir -p /tmp/old /tmp/rc && tar xzf .device/old_src.tar.gz -C /tmp/old
    for label in ${LABELS:-before after}; do
      code=src
      case "$label" in before*) code=/tmp/old/src ;; esac
      # shellcheck disable=SC2086  # TREES, TAUS: several values
      PYTHONPATH=$code:/tmp/deps timeout "${RC_S:-200}" python benchmarks/round_cost_gpu.py --trees ${TREES:-4,8,15 5,8,15 4,8,31} \
        --tau ${TAUS:-2.84 2.90 3.06} --profile --label "$label" --out "$OUT/rc_$label.json" \
        --profile-out "/tmp/rc/prof_$label.txt" > "/tmp/rc/$label.log" 2>&1 || echo "$label exit $?" >> "/tmp/rc/$label.log"
      grep -E "^plain step|^\{|kernels, |exit" "/tmp/rc/$label.log" | cut -c1-400
    done
    if [ -n "${TESTS:-}" ]; then
      PYTHONPATH=src:/tmp/deps timeout "${TESTS_S:-200}" python -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py \
        -k "$TESTS" > /tmp/rc/gpu_tests.log 2>&1 || true
      tail -n 5 /tmp/rc/gpu_tests.log
    fi
    (cd /tmp && tar cf "$OUT/rc.tar" rc) || true
    ;;
  topk)
    # a greedy draft's per-depth selection alone, eager and compiled: torch.topk against stable sorts (draft_topk_gpu.py)
    timeout "${TOPK_S:-240}" python benchmarks/draft_topk_gpu.py --compile --out "$OUT/draft_topk.json" \
      > "$OUT/draft_topk.log" 2>&1 || echo "draft_topk exit $?" >> "$OUT/draft_topk.log"
    tail -n 40 "$OUT/draft_topk.log"
    ;;
  tiling)
    # one block's attention alone: eager against the split-KV kernels per tiling (decode_attention_gpu.py)
    timeout 300 python benchmarks/decode_attention_gpu.py --profile --out "$OUT/decode_attention.json" \
      --block-n ${BLOCK_N:-32,64} --warps ${WARPS:-2,4} --max-splits ${SPLITS:-16,32,64} --prefetch 0,1 \
      > "$OUT/decode_attention.log" 2>&1 || echo "tiling exit $?" >> "$OUT/decode_attention.log"
    grep -E "eager|best" "$OUT/decode_attention.log" | tail -n 12
    ;;
  gputests)
    # the engine's GPU tests (split-kv included), then the float32 identity test with matvec='reduce' run for
    # its assertion message (--runxfail)
    timeout 400 python -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py tests/test_engine_llama.py \
      -k 'cuda or gpu' > "$OUT/gpu_tests.log" 2>&1 || true
    timeout 120 python -m pytest -q -p no:cacheprovider --runxfail tests/test_engine_cuda.py -k reduce \
      > "$OUT/xfail.log" 2>&1 || true
    tail -n 12 "$OUT/gpu_tests.log" "$OUT/xfail.log"
    ;;
  attention)
    shift
    # the fast target's attention eager, then split-kv (its Triton kernels); see spec_pair
    spec_pair attention eager "--attention eager" split-kv "--attention split-kv" "$@"
    ;;
  rounds)
    shift
    # verification and the drafter through eyas' kernels (triton-verify, SmolLM2's auto; HF compiled beside it), then
    # cuBLAS verification (triton: the kernels on the one-token steps only); see spec_pair
    spec_pair rounds triton-verify "--matvec triton-verify --attention split-kv" triton "--matvec triton --attention split-kv" "$@"
    ;;
  kernels)
    shift
    # the fast target on cuBLAS and the eager order, then on its default (auto: the Triton kernels for plain steps,
    # verification and the drafter's steps): what they do to eyas plain and to speculative decoding; see spec_pair
    spec_pair kernels cublas "--matvec gemm --attention eager" auto "" "$@"
    ;;
  compare)
    shift
    # the drafter just trained against the shipped one, MT-bench at temperature 0, one process each, same prompts
    # and trees; HF generate compiled beside the new one. Results: $OUT/compare.tar (both result dirs), compare.log
    C=${COMMIT:?set COMMIT to the commit whose tree was sent}
    for who in new shipped; do
      D=$WORK/drafter SKIP=hf_eager
      [ "$who" = shipped ] && D=src/eyas/interop/embedded/smollm2-135m-instruct SKIP=hf_eager,hf_compiled
      timeout 262 python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft "$D" --out-dir "/tmp/compare/$who" \
        --commit "$C" --sets mt_bench --prompts-per-set 24 --temperatures 0 --trees 8,8,48 6,10,60 --chains 4 \
        --select-prompts 4 --skip "$SKIP" --no-tree-auto --budget-s 235 "$@" >> "$OUT/compare.log" 2>&1 \
        || echo "compare $who exit $?" >> "$OUT/compare.log"
    done
    (cd /tmp && tar cf "$OUT/compare.tar" compare) || true
    tail -n 40 "$OUT/compare.log"
    ;;
  *)
    sed -n 2,22p "$0"
    exit 2
    ;;
esac
