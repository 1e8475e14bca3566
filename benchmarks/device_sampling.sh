#!/usr/bin/env bash
# Issue 32 on the lent H200, in few calls (each call: `bash benchmarks/device_sampling.sh STEP`).
# The work tree (30 MB with the shipped drafter) leaves room for a quarter of the SmolLM2 GGUF a call:
# split it in four (`split -n 4 -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf .device/g4/smol.p`, git-ignored)
# and carry one part a call, the next call within the machine's 30 s of warmth.
#
#   part         keep the GGUF parts carried in this call in /tmp; install the py3.12 wheels (gguf,
#                pydantic) carried in .device/wheels into /tmp/deps, once
#   start ARGS   join the GGUF (sha256 checked), then in the background (setsid: it outlives the call):
#                the engine's GPU tests of sampling (losslessness, one wait a round), spec_gpu.py on the six
#                EAGLE sets at temperatures 0 and 1 (trees selected per temperature) and, at temperature 1 on
#                MT-bench, drafts drawn from q (sampled_drafts="gumbel") against top-k drafts; then waits
#   final ARGS   join the GGUF, then in the background: `eyas bench` on the six EAGLE sets at temperatures 0
#                and 1 (--tree auto against fixed trees on the same prompts, eyas plain, HF generate with a
#                static cache and torch.compile; ARGS: more bench options), then the engine's GPU tests
#                (float32 greedy identity, sampling losslessness on the fast target, one wait a round); waits
#   wait [S]     wait up to S seconds (default 540) for it to end; copy what is done into $OUT
#
# Results: $OUT/gputests.log, $OUT/spec.tar (/tmp/spec/{six,gumbel}/results.{json,md}), $OUT/spec.log;
# final: $OUT/bench.json, bench.png, bench.log, gputests.log.
set -euo pipefail
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH=src:/tmp/deps TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=30 PYTHONUNBUFFERED=1
D=src/eyas/interop/embedded/smollm2-135m-instruct
RUN=/tmp/spec

collect() {
  [ -d "$RUN/six" ] && (cd /tmp && tar cf "$OUT/spec.tar" spec/six spec/gumbel 2>/dev/null) || true
  for f in "$RUN"/*.log "$RUN"/bench.json "$RUN"/bench.png; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  true
}

join_gguf() {
  for f in .device/g[0-9]/smol.p*; do [ -f "$f" ] && cp "$f" /tmp/; done
  [ -f /tmp/smol.gguf ] || cat /tmp/smol.p[0-9] > /tmp/smol.gguf
  echo "$SHA  /tmp/smol.gguf" | sha256sum -c -
  python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
}

case "${1:-}" in
  part)
    for f in .device/g[0-9]/smol.p*; do [ -f "$f" ] && cp "$f" /tmp/ && echo "kept $f"; done
    if [ -d .device/wheels ] && [ ! -d /tmp/deps ]; then
      pip install -q --no-index --no-deps --target /tmp/deps .device/wheels/*.whl 2>&1 | grep -v "root user" || true
    fi
    ls -la /tmp/smol.p* 2>/dev/null || true
    ;;
  start)
    shift
    join_gguf
    C=${COMMIT:?set COMMIT to the commit whose tree was sent}
    mkdir -p "$RUN"
    rm -f "$RUN/DONE"
    setsid nohup bash -c "
      timeout 240 python -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py -k 'lossless or synchronises' \
        > $RUN/gputests.log 2>&1; echo \"gputests exit \$?\" >> $RUN/gputests.log
      timeout 420 python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft $D --out-dir $RUN/six --commit $C \
        --sets mt_bench,humaneval,gsm8k,alpaca,sum,qa --temperatures 0,1 --select-per-temperature --select-prompts 6 \
        --select-share 0.25 --skip hf_eager --no-tree-auto --budget-s 400 --compile-reserve-s 100 $* \
        > $RUN/spec.log 2>&1 || echo \"spec_gpu exit \$?\" >> $RUN/spec.log
      timeout 120 python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft $D --out-dir $RUN/gumbel --commit $C \
        --sets mt_bench --prompts-per-set 16 --temperatures 1 --trees 4,8,15 4,2,6 --chains 3 --select-prompts 4 \
        --select-per-temperature --skip hf_eager,hf_compiled --no-tree-auto --no-profile --budget-s 110 \
        --engine-kwargs '{\"sampled_drafts\": \"gumbel\"}' > $RUN/gumbel.log 2>&1 || echo \"gumbel exit \$?\" >> $RUN/gumbel.log
      echo done > $RUN/DONE" > /dev/null 2>&1 &
    sleep 5
    bash "$0" wait "${WAIT_S:-520}"
    ;;
  final)
    shift
    join_gguf
    mkdir -p "$RUN"
    rm -f "$RUN/DONE"
    setsid nohup bash -c "
      timeout ${BENCH_S:-420} python -m eyas.cli.main bench --target /tmp/smol.gguf --draft $D \
        --prompts mt_bench --prompts humaneval --prompts gsm8k --prompts alpaca --prompts sum --prompts qa \
        --temperatures 0,1 --max-new-tokens 128 --out $RUN/bench.json --png $RUN/bench.png --json $* \
        > $RUN/bench.stdout 2> $RUN/bench.log; echo \"bench exit \$?\" >> $RUN/bench.log
      timeout ${TESTS_S:-300} python -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py \
        -k 'float32 and triton-verify or lossless and fast or synchronises' > $RUN/gputests.log 2>&1
      echo \"gputests exit \$?\" >> $RUN/gputests.log
      echo done > $RUN/DONE" > /dev/null 2>&1 &
    sleep 5
    bash "$0" wait "${WAIT_S:-520}"
    ;;
  wait)
    limit=${2:-540} t=0
    while [ ! -f "$RUN/DONE" ] && [ "$t" -lt "$limit" ]; do sleep 10; t=$((t + 10)); done
    [ -f "$RUN/DONE" ] && echo "finished" || echo "still running after ${t} s"
    collect
    tail -n 5 "$RUN/gputests.log" 2>/dev/null || true
    tail -n 25 "$RUN/spec.log" 2>/dev/null || true
    tail -n 8 "$RUN/gumbel.log" 2>/dev/null || true
    grep -av "warn\|softmax\|^$\|it/s\]" "$RUN/bench.log" 2>/dev/null | tail -n 30 || true
    ;;
  *)
    echo "usage: $0 part | start [spec_gpu.py ARGS] | final [eyas bench ARGS] | wait [S]" >&2
    exit 2
    ;;
esac
