#!/usr/bin/env bash
# One device session on a GPU host without a package index (see tools/bundle.py):
#   bash tools/gpu_session.sh STAGE...   stages: setup test bench ab detach collect wait step attention rowops codec codecload gil engine aotiprobe clientcap gateway realtime httpclients
# (detach: the stages in DETACH_STAGES (default `bench`) in a process session of their own, writing to DETACH_DIR
#  (default build/detached), so that a run longer than one device call (a soak) goes on between calls; several
#  detached runs side by side each have their own DETACH_DIR; collect [WAIT_S]: wait for DETACH_DIR's run to end,
#  then its results into $OUT and all of DETACH_DIR as $OUT/<its name>.tgz: a device call returns only 8 files;
#  wait: until the detached run in WAIT_FOR has ended, e.g. timed stages queued behind a soak)
# (step: STEP_TREES lists the checkouts whose chattts_triton/ and bench/ run the probe, default `.`; another's,
#  e.g. `git archive` of the commit before a change, measures the step before it)
# (ab: one bench.run per entry of AB_RUNS, "NAME[@TREE]=FLAGS;…", each with BENCH_ARGS and its own FLAGS, from the
#  checkout TREE (default `.`; e.g. `git archive` of the commit before a change): an A/B on one host, one after the
#  other, each packed into $OUT/ab-NAME.tgz with its log beside it as $OUT/ab-NAME.log)
# (test: PYTEST_ARGS picks the tests, default the whole GPU suite; quotes in it are kept, e.g. -k "a or b")
# Writes logs and results under $OUT (or build/gpu-out).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-out}"; mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"; ROOT="$PWD"
ENV="${CHATTTS_ENV:-/tmp/chattts-env.sh}"  # the bundle's exports, written by its first install
if [ ! -f "$ENV" ]; then
  bash .bundle/install.sh 2>&1 | tee "$OUT/install.log" | sed -n '/^Export these/,$p' | grep '^export' > "$ENV"
fi
source "$ENV"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
export_repo() {  # DIR [export args]: the repository the GPU benches load (the defaults, on GPU 0), exported once
  local dir="$1"; shift
  [ -f "$dir/manifest.json" ] || python3 -m export --assets build/assets-full --out "$dir" --gpus 0 "$@" 2>&1 | tail -2
}
for stage in "$@"; do
  case "$stage" in
    setup)
      [ -f build/assets-full/.complete ] || { python3 -m export.synthetic build/assets-full --size full && touch build/assets-full/.complete; } ;;
    test)  # -v: each test's result is in the log as it ends, so a call that runs out keeps the names
      eval "python3 -m pytest -p no:cacheprovider -v -m gpu ${PYTEST_ARGS:-tests/test_gpu.py} -s" 2>&1 | tee "$OUT/test_gpu.log" ;;
    bench)
      python3 -m bench.run --assets build/assets-full --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    ab)
      IFS=';' read -ra runs <<< "${AB_RUNS:?ab: AB_RUNS names the runs, e.g. \"one=;two=--instances 2\"}"
      for run in "${runs[@]}"; do  # refused up front: a run's mistake would only show in its own log, minutes on
        case "$run" in
          *=*) ;;
          *) echo "ab: AB_RUNS entry '$run' has no '=': write NAME[@TREE]=FLAGS (FLAGS may be empty)" >&2; exit 2 ;;
        esac
      done
      for run in "${runs[@]}"; do
        head="${run%%=*}"; flags="${run#*=}"; name="${head%%@*}"; tree=.
        [ "$head" = "$name" ] || tree="${head#*@}"
        echo "$(date +%T) ab $name (tree $tree): ${BENCH_ARGS:-} $flags" | tee -a "$OUT/ab.log"
        (cd "$tree" && PYTHONPATH="$PWD:$PYTHONPATH" python3 -m bench.run --assets "$ROOT/build/assets-full" \
          --out "$OUT/ab-$name" --name "$name" --repo "$ROOT/build/repo-ab-$name" ${BENCH_ARGS:-} $flags) \
          > "$OUT/ab-$name.log" 2>&1
        tail -3 "$OUT/ab-$name.log" | tee -a "$OUT/ab.log"
        # one file a run: a device call brings back only a few files, and a run's folder holds a dozen
        if [ -d "$OUT/ab-$name" ]; then
          tar czf "$OUT/ab-$name.tgz" -C "$OUT" "ab-$name" && rm -rf "${OUT:?}/ab-$name"
        fi
      done ;;
    detach)
      dir="${DETACH_DIR:-build/detached}"; rm -rf "$dir" && mkdir -p "$dir"
      # the marker `done` is written whatever the stages' fate, so collect never waits out its deadline for a dead run
      OUT="$dir" setsid nohup bash -c "bash tools/gpu_session.sh ${DETACH_STAGES:-bench}; touch '$dir/done'" \
        > "$dir/session.log" 2>&1 < /dev/null &
      echo "detached ${DETACH_STAGES:-bench}: pid $!, log $dir/session.log" ;;
    collect)  # ends when DETACH_DIR's run has (or after WAIT_S), then its files into $OUT
      dir="${DETACH_DIR:-build/detached}"; deadline=$(( $(date +%s) + ${WAIT_S:-540} ))
      while [ ! -f "$dir/done" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
      [ -f "$dir/done" ] || echo "$dir still running at the deadline"
      tail -5 "$dir/session.log" 2>/dev/null
      cp "$dir"/*.json "$dir"/*.md "$OUT"/ 2>/dev/null
      tar czf "$OUT/$(basename "$dir").tgz" -C "$(dirname "$dir")" "$(basename "$dir")"; ls -la "$OUT" ;;
    wait)  # until the detached run in WAIT_FOR has ended: stages that must have the GPU to themselves
      until [ -f "${WAIT_FOR:-build/detached}/done" ]; do sleep 5; done
      echo "$(date +%T) ${WAIT_FOR:-build/detached} has ended" ;;
    step)  # one after the other under the same conditions: this tree (step/), then each other one (step-<its folder>/)
      for tree in ${STEP_TREES:-.}; do
        name=step; [ "$tree" = . ] || name="step-$(basename "$tree")"; mkdir -p "$OUT/$name"
        (cd "$tree" && PYTHONPATH="$PWD:$PYTHONPATH" python3 -m bench.probes.step --assets "$ROOT/build/assets-full" \
          --out "$OUT/$name" ${STEP_ARGS:-}) 2>&1 | tee "$OUT/$name.log"
      done ;;
    attention)  # the decode-attention kernel alone by launch layout and rows (bench/probes/attention.py; ATTENTION_ARGS)
      python3 -m bench.probes.attention --out "$OUT/attention.json" ${ATTENTION_ARGS:-} 2>&1 | tee "$OUT/attention.log" ;;
    rowops)  # one row's layer products alone by launch layout (bench/probes/rowops.py; ROWOPS_ARGS)
      python3 -m bench.probes.rowops --out "$OUT/rowops.json" ${ROWOPS_ARGS:-} 2>&1 | tee "$OUT/rowops.log" ;;
    codec)
      export_repo build/codec-repo ${CODEC_EXPORT_ARGS:-}
      python3 -m bench.probes.stream_codec --repo build/codec-repo --out "$OUT/stream-codec.json" 2>&1 | tee "$OUT/stream_codec.log" ;;
    codecload)  # the decoder + Vocos alone by batch size: GPU ms per utterance (bench/probes/codec_load.py; CODECLOAD_ARGS)
      export_repo build/bench-repo
      python3 -m bench.probes.codec_load --repo build/bench-repo --out "$OUT/codec-load.json" ${CODECLOAD_ARGS:-} 2>&1 | tee "$OUT/codec_load.log" ;;
    gil)  # who holds the GIL in the GPT model's process under load (bench/probes/gil.py; GIL_ARGS)
      export_repo build/bench-repo
      python3 -m bench.probes.gil --repo build/bench-repo --out "$OUT/gil.json" ${GIL_ARGS:---concurrency 256 --tokens 150} 2>&1 | tee "$OUT/gil.log" ;;
    engine)  # the GPT engine alone under the served load, no other process on the GPU (bench/probes/engine_load.py; ENGINE_ARGS)
      export_repo build/bench-repo
      python3 -m bench.probes.engine_load --repo build/bench-repo --out "$OUT/engine-load.json" ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine_load.log" ;;
    aotiprobe)  # can this torch load any AOTInductor package? (bench/probes/aoti.py: a two-layer one, in a fresh process)
      python3 -m bench.probes.aoti 2>&1 | tee "$OUT/aoti_probe.log" ;;
    clientcap)  # the stream client's own share of a first chunk, against a stand-in server (bench/probes/client_capacity.py; CLIENTCAP_ARGS)
      python3 -m bench.probes.client_capacity --stream --out "$OUT/client-capacity-stream.json" ${CLIENTCAP_ARGS:-} 2>&1 | tee "$OUT/client_capacity.log" ;;
    gateway)  # the speech gateway against direct gRPC (bench/gateway.py; GATEWAY_ARGS): bench.gateway starts the
      # default export through the launcher and stops it (SIGTERM, drain); ≈ 100 s to ready + ≈ 110 s measured
      export_repo build/bench-repo
      python3 -m bench.gateway --repo build/bench-repo --out "$OUT/gateway" --concurrency 256 --tokens 150 --requests 30 \
        --seconds 12 --phases 3 --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) CPU cores" \
        ${GATEWAY_ARGS:-} 2>&1 | tee "$OUT/gateway.log" ;;
    realtime)  # the realtime WebSocket (bench/realtime.py; REALTIME_ARGS): first audio at 1 session against the
      # first chunk, 64 sessions of LLM-speed text for gaps, barge-in and the slots' release, on the default export
      # through the launcher; needs `websockets` on the host (the client here, and uvicorn's WebSocket server)
      python3 -c "import websockets" || { echo "realtime: websockets is not installed on this host"; continue; }
      export_repo build/bench-repo
      python3 -m bench.realtime --repo build/bench-repo --out "$OUT/realtime" --sessions 64 --frames 96 --turns 30 \
        --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) CPU cores" \
        ${REALTIME_ARGS:-} 2>&1 | tee "$OUT/realtime.log" ;;
    httpclients)  # our HTTP clients (asyncio, sync, Locust) beside perf_analyzer over HTTP at 64 and 256, with
      # tritonclient.http.aio as it comes and gRPC for comparison (bench/http_clients.py; HTTPCLIENTS_ARGS), on the
      # default export through the launcher; ≈ 100 s to ready + ≈ 8 min measured: run it detached. Locust's users
      # in 4 worker processes (the bundle's locust group), so that no one gevent loop decodes every answer
      export_repo build/bench-repo
      python3 -m bench.http_clients --repo build/bench-repo --out "$OUT/http-clients" --concurrency 64,256 --tokens 150 \
        --paths perf_analyzer,asyncio,sync,locust,tritonclient-aio,grpc --seconds 20 --warmup 10 --locust-processes 4 \
        --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) CPU cores" \
        ${HTTPCLIENTS_ARGS:-} 2>&1 | tee "$OUT/http_clients.log"
      cp "$OUT"/http-clients/http-clients.{json,md} "$OUT"/ 2>/dev/null ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
