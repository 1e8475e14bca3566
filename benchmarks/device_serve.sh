#!/usr/bin/env bash
# Issue 33 on the lent GPU, in few calls (each call: `bash benchmarks/device_serve.sh STEP`).
# The work tree (39 MB with benchmarks/grown) leaves room for a fifth of the SmolLM2 GGUF a call: split
# it in five (`split -n 5 -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf .device/g5/smol.p`, git-ignored; any
# .device/g<N>/ split is taken, joined in order) and carry one part a call, the next call within the
# machine's 30 s of warmth; the py3.12 wheels the image lacks
# (gguf, pydantic, fastapi, uvicorn and their needs) travel in .device/wheels with the first.
#
#   part        keep the GGUF parts carried in this call in /tmp; install the wheels into /tmp/deps once
#   start       join the GGUF (sha256 checked), then in the background (setsid: it outlives the call):
#               serve_load.py (it launches `eyas serve` with speculation auto, then off, on a fresh
#               compile cache: the first is the cold start; 1..256 clients, temperatures 0 and 1, a warm
#               pass first), serve_startup.py (warm starts of `eyas serve` on the cache serve_load filled),
#               with PROFILE=1 startup_profile_gpu.py (a warm start under cProfile, in-process),
#               and with ROWS=1 row_speculation_cpu.py on the GPU (the engine's rounds per rows and depth)
#               (env: CLIENTS, TEMPS, SPEC (serve_load's --speculation, e.g. auto,off,off/in-process),
#               ONE=1: --one-at-a-time, LOAD_S, STARTUP_S (1: no start-up runs), WAIT_S)
#   bars        issue 33's bars on a fresh cache (RUN=/tmp/serve3): `eyas serve` started cold, then warm
#               twice (PROFILE=1: then a warm start under cProfile); a warming load (speculation off);
#               serve_load.py (SPEC, CLIENTS, TEMPS, REQUESTS, MIN_REQUESTS) one server at a time
#               (LOADS=0: no load); ROWS=1: after the starts, row_speculation_cpu.py on the GPU, warm
#               (the engine's batched rounds against plain steps per rows and depth, ROW_SIZES)
#   rows        the engine's batched rounds alone, warm (RUN=/tmp/rows): row_speculation_cpu.py, ROW_SIZES x
#               (plain steps, DEPTHS chains, TREES trees) at TEMPS, STEPS rounds a setting (PLAIN_EVERY=N:
#               every N-th of a round setting's steps plain, the drafter catching up after it; a list such as
#               PLAIN_EVERY='0 4' runs one pass each, rows.json then rows-every4.json; NO_CATCH_UP=1: not;
#               ROWS_PROFILE=1: each setting then profiled, step_profile.py, its tables in $OUT/prof.tar;
#               PARALLEL=1,2,4: then lone sessions side by side, parallel_sessions_gpu.py, into parallel.json)
#   wait [S]    wait up to S seconds (default 540) for it to end; copy what is done into $OUT
#
# Results: $OUT/serve_load.json, serve_load.log, startup.json, startup.log, profile.json, profile.log, rows.json,
# rows.log, servers.log (bars: startup.json, profile.json, warming.json, serve_load.json, runs.log, servers.log)
set -euo pipefail
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH=src:/tmp/deps TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=30 PYTHONUNBUFFERED=1
# Byte-code kept as an installed package keeps it: without it every process compiled ~1,500 modules from
# source (5.8 s of a warm start's cProfile on the H100 image), which no user's pip install pays
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
D=${DRAFT:-src/eyas/interop/embedded/smollm2-135m-instruct}  # DRAFT: another drafter directory
RUN=${RUN:-/tmp/serve}

collect() {
  for f in "$RUN"/*.json "$RUN"/*.log "$RUN"/*.png; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  [ -d "$RUN/prof" ] && (cd "$RUN" && tar cf "$OUT/prof.tar" prof*)  # rows with ROWS_PROFILE=1: the tables
  for f in /tmp/eyas-serve-*.log; do  # each launched server's own log, its last 100 kB
    [ -f "$f" ] && { echo "== $f"; tail -c 100000 "$f"; } >> "$OUT/servers.log"
  done
  true
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
    for f in .device/g[0-9]/smol.p*; do [ -f "$f" ] && cp "$f" /tmp/; done
    [ -f /tmp/smol.gguf ] || cat /tmp/smol.p[0-9] > /tmp/smol.gguf
    echo "$SHA  /tmp/smol.gguf" | sha256sum -c -
    python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
    mkdir -p "$RUN"
    rm -f "$RUN/DONE"
    setsid nohup bash -c "
      export EYAS_CACHE=/tmp/eyas-cache
      timeout ${LOAD_S:-780} python benchmarks/serve_load.py --target /tmp/smol.gguf --draft $D --tree 4,8,15 \
        --clients ${CLIENTS:-1,4,16,64,256} --requests 2 --min-requests 32 --max-tokens 128 --temperatures ${TEMPS:-0,1} --speculation ${SPEC:-auto,off} ${ONE:+--one-at-a-time} \
        --max-rows 256 --warm-pass --json > $RUN/serve_load.json 2> $RUN/serve_load.log
      echo \"serve_load exit \$?\" >> $RUN/serve_load.log
      timeout ${STARTUP_S:-300} python benchmarks/serve_startup.py --target /tmp/smol.gguf --draft $D \
        --cache /tmp/eyas-cache --starts 2 --json -- --max-rows 256 > $RUN/startup.json 2> $RUN/startup.log
      echo \"startup exit \$?\" >> $RUN/startup.log
      if [ \"${PROFILE:-0}\" = 1 ]; then
        timeout ${PROFILE_S:-300} python benchmarks/startup_profile_gpu.py --target /tmp/smol.gguf --draft $D \
          --cache /tmp/eyas-cache --json > $RUN/profile.json 2> $RUN/profile.log
        echo \"profile exit \$?\" >> $RUN/profile.log
      fi
      if [ \"${ROWS:-0}\" = 1 ]; then
        timeout ${ROWS_S:-240} python benchmarks/row_speculation_cpu.py --target /tmp/smol.gguf --draft $D \
          --rows 4,16,64 --depths 1,2,3,4 --temperatures 0,1 --steps 24 --json --plot $RUN/rows.png \
          > $RUN/rows.json 2> $RUN/rows.log
        echo \"rows exit \$?\" >> $RUN/rows.log
      fi
      echo done > $RUN/DONE" > /dev/null 2>&1 &
    sleep 5
    bash "$0" wait "${WAIT_S:-520}"
    ;;
  bars)
    # Issue 33's bars in one job, on a fresh cache /tmp/eyas-cache3 (RUN=/tmp/serve3; `RUN=/tmp/serve3
    # bash $0 wait` in the next calls): `eyas serve` launched three times (serve_startup.py --fresh:
    # the cold start, then two warm ones); a load with speculation off that compiles the batch's
    # shapes (warming.json, not a measure); then serve_load.py, SPEC (default auto,off) one server at
    # a time on the warm cache, CLIENTS x TEMPS
    for f in .device/g[0-9]/smol.p*; do [ -f "$f" ] && cp "$f" /tmp/; done
    [ -f /tmp/smol.gguf ] || cat /tmp/smol.p[0-9] > /tmp/smol.gguf
    echo "$SHA  /tmp/smol.gguf" | sha256sum -c -
    python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
    RUN=/tmp/serve3 && rm -rf "$RUN" /tmp/eyas-cache3 && mkdir -p "$RUN"
    L="python benchmarks/serve_load.py --target /tmp/smol.gguf --draft $D --tree 4,8,15 --max-tokens 128 --max-rows 256 --warm-pass --json"
    setsid nohup bash -c "
      export EYAS_CACHE=/tmp/eyas-cache3
      echo \"== serve_startup \$(date -u +%T)\" >> $RUN/runs.log
      timeout ${STARTUP_S:-420} python benchmarks/serve_startup.py --target /tmp/smol.gguf --draft $D \
        --cache /tmp/eyas-cache3 --fresh --starts 3 --json -- --max-rows 256 > $RUN/startup.json 2>> $RUN/runs.log
      echo \"exit \$? \$(date -u +%T)\" >> $RUN/runs.log
      if [ \"${PROFILE:-0}\" = 1 ]; then
        echo \"== warm start in-process under cProfile \$(date -u +%T)\" >> $RUN/runs.log
        timeout 300 python benchmarks/startup_profile_gpu.py --target /tmp/smol.gguf --draft $D --cache /tmp/eyas-cache3 \
          --json > $RUN/profile.json 2>> $RUN/runs.log
        echo \"exit \$? \$(date -u +%T)\" >> $RUN/runs.log
      fi
      if [ \"${ROWS:-0}\" = 1 ]; then
        echo \"== row speculation (engine alone, warm) \$(date -u +%T)\" >> $RUN/runs.log
        timeout ${ROWS_S:-300} python benchmarks/row_speculation_cpu.py --target /tmp/smol.gguf --draft $D \
          --rows ${ROW_SIZES:-1,2,4,8,16,64} --depths 1,2,3,4 --temperatures 0,1 --steps 24 --json --plot $RUN/rows.png \
          > $RUN/rows.json 2>> $RUN/runs.log
        echo \"exit \$? \$(date -u +%T)\" >> $RUN/runs.log
      fi
      [ \"${LOADS:-1}\" = 0 ] && { echo done > $RUN/DONE; exit 0; }
      echo \"== warming load \$(date -u +%T)\" >> $RUN/runs.log
      timeout ${WARMING_S:-300} $L --clients 4,16,64,256 --requests 1 --temperatures 0,1 --speculation off \
        > $RUN/warming.json 2>> $RUN/runs.log
      echo \"exit \$? \$(date -u +%T)\" >> $RUN/runs.log
      echo \"== serve_load \$(date -u +%T)\" >> $RUN/runs.log
      timeout ${LOAD_S:-600} $L --clients ${CLIENTS:-1,4,16,64,256} --requests ${REQUESTS:-4} --min-requests ${MIN_REQUESTS:-128} \
        --temperatures ${TEMPS:-0,1} --speculation ${SPEC:-auto,off} --one-at-a-time > $RUN/serve_load.json 2>> $RUN/runs.log
      echo \"exit \$? \$(date -u +%T)\" >> $RUN/runs.log
      echo done > $RUN/DONE" > /dev/null 2>&1 &
    sleep 5
    RUN=$RUN bash "$0" wait "${WAIT_S:-540}"
    ;;
  rows)
    # The engine's batched rounds alone, warm (RUN=/tmp/rows; `RUN=/tmp/rows bash $0 wait` in the
    # next calls): row_speculation_cpu.py on the GPU, ROW_SIZES x (plain, DEPTHS chains, TREES trees)
    # at TEMPS
    for f in .device/g[0-9]/smol.p*; do [ -f "$f" ] && cp "$f" /tmp/; done
    [ -f /tmp/smol.gguf ] || cat /tmp/smol.p[0-9] > /tmp/smol.gguf
    echo "$SHA  /tmp/smol.gguf" | sha256sum -c -
    python -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
    RUN=/tmp/rows && rm -rf "$RUN" && mkdir -p "$RUN"
    setsid nohup bash -c "
      export EYAS_CACHE=/tmp/eyas-cache-rows
      for every in ${PLAIN_EVERY:-0}; do
        echo \"== row speculation (engine alone, warm), plain every \$every \$(date -u +%T)\" >> $RUN/runs.log
        suffix=\$( [ \$every = 0 ] || echo -every\$every )
        plain=\$( [ \$every = 0 ] || echo --plain-every \$every )
        timeout ${ROWS_S:-540} python benchmarks/row_speculation_cpu.py --target /tmp/smol.gguf --draft $D \
          --rows ${ROW_SIZES:-1,4,16,64} --depths ${DEPTHS:-2,3} --trees '${TREES:-3,4,12;4,4,16;5,4,20;4,8,24}' \
          --temperatures ${TEMPS:-0,1} --steps ${STEPS:-32} \$plain ${NO_CATCH_UP:+--no-catch-up} \
          ${ROWS_PROFILE:+--profile $RUN/prof\$suffix} --json \
          --plot $RUN/rows\$suffix.png > $RUN/rows\$suffix.json 2>> $RUN/rows.log
        echo \"exit \$? \$(date -u +%T)\" >> $RUN/runs.log
      done
      if [ -n \"${PARALLEL:-}\" ]; then
        echo \"== lone sessions side by side \$(date -u +%T)\" >> $RUN/runs.log
        timeout ${PARALLEL_S:-300} python benchmarks/parallel_sessions_gpu.py --target /tmp/smol.gguf --draft $D \
          --sessions ${PARALLEL} --temperatures ${PARALLEL_TEMPS:-0,1} --json > $RUN/parallel.json 2>> $RUN/parallel.log
        echo \"exit \$? \$(date -u +%T)\" >> $RUN/runs.log
      fi
      echo done > $RUN/DONE" > /dev/null 2>&1 &
    sleep 5
    RUN=$RUN bash "$0" wait "${WAIT_S:-540}"
    ;;
  wait)
    limit=${2:-540} t=0
    while [ ! -f "$RUN/DONE" ] && [ "$t" -lt "$limit" ]; do sleep 10; t=$((t + 10)); done
    [ -f "$RUN/DONE" ] && echo "finished" || echo "still running after ${t} s"
    collect
    grep -av "warn\|^$" "$RUN/serve_load.log" 2>/dev/null | tail -n 30 || true
    tail -n 6 "$RUN/startup.log" 2>/dev/null || true
    tail -n 30 "$RUN/rows.log" 2>/dev/null || true
    tail -n 12 "$RUN/profile.log" 2>/dev/null || true
    grep -a "^==\|^exit\|ready in\|failed\|level:\|Error" "$RUN/runs.log" 2>/dev/null | tail -n 40 || true
    ;;
  *)
    echo "usage: $0 part | start | bars | rows | wait [S]" >&2
    exit 2
    ;;
esac
