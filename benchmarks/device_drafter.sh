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
#   collect      the drafter (bf16 shards + a tar of its small files), the summary and the logs into $OUT
#   bench [ARGS] benchmarks/spec_gpu.py on MT-bench with the drafter, results into $OUT/spec (COMMIT=sha)
set -euo pipefail
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WORK=benchmarks/out/smollm2
LOG=/tmp/drafter/run.log
export PYTHONPATH=src:/tmp/deps TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=30
mkdir -p /tmp/drafter

wait_run() {
  local limit=${1:-540} t=0
  while [ ! -f /tmp/drafter/DONE ] && [ "$t" -lt "$limit" ]; do sleep 10; t=$((t + 10)); done
  [ -f /tmp/drafter/DONE ] && echo "run finished: $(cat /tmp/drafter/DONE)" || echo "still running after ${t} s"
  tr '\r' '\n' < "$LOG" | grep -av "it/s\]$\|s/it\]$" | tail -n 40
}

case "${1:-}" in
  setup)
    pip install -q --no-index --no-deps --target /tmp/deps .device/wheels/*.whl 2>&1 | grep -v "root user" || true
    cp .device/gguf/smol.part00 /tmp/
    if [ -f .device/old_src.tar.gz ]; then mkdir -p /tmp/old && tar xzf .device/old_src.tar.gz -C /tmp/old; fi
    python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
    ;;
  start)
    shift
    cat /tmp/smol.part00 .device/gguf/smol.part01 > /tmp/smol.gguf
    echo "$SHA  /tmp/smol.gguf" | sha256sum -c -
    rm -f /tmp/drafter/DONE
    setsid nohup bash -c "python benchmarks/train_smollm2_drafter.py run --target /tmp/smol.gguf --no-copy-to-out $* \
      > $LOG 2>&1; echo \"exit \$?\" > /tmp/drafter/DONE" > /dev/null 2>&1 &
    wait_run 530
    ;;
  wait)
    wait_run "${2:-540}"
    ;;
  collect)
    python - <<'EOF'
import sys, pathlib as p
sys.path.insert(0, "benchmarks")
import train_smollm2_drafter as t
print(t.transport_copy(p.Path("benchmarks/out/smollm2/drafter"), p.Path("/tmp/drafter/bf16")))
EOF
    cp /tmp/drafter/bf16/*.safetensors "$OUT/"
    (cd /tmp/drafter/bf16 && tar cf "$OUT/drafter_meta.tar" --exclude='*.safetensors' .)
    cp "$WORK/summary.json" "$OUT/train_summary.json"
    tr '\r' '\n' < "$LOG" | grep -av "it/s\]$\|s/it\]$" > "$OUT/run.log"
    ls -la "$OUT"
    ;;
  bench)
    shift
    python benchmarks/spec_gpu.py --target /tmp/smol.gguf --draft "$WORK/drafter" --out-dir "$OUT/spec" \
      --commit "${COMMIT:?set COMMIT to the commit whose tree was sent (the machine has a stale .git)}" \
      --sets mt_bench --prompts-per-set 24 --temperatures 0 --trees 6,10,60 8,8,48 6,16,80 --chains 4 6 \
      --select-prompts 6 --budget-s 390 "$@"
    ;;
  *)
    sed -n 2,16p "$0"
    exit 2
    ;;
esac
