#!/usr/bin/env bash
# One pass of the GPU checks on a machine with one CUDA GPU, no network and no install of this
# package, the wheels it lacks carried in .whl/ (ignored by git: name it in the run's carry), with
# OUT set to a folder whose files come back. The wheels, made where pip reaches PyPI (for the GPU
# machine's Python 3.12; the image has torch, numpy, msgpack, safetensors, httpx, pytest, ...):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0 \
#     msgspec==0.22.0 structlog==26.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 typing-extensions==4.16.0 blake3==1.0.11 jsonschema==4.26.0 \
#     referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 math-verify==0.9.0 \
#     latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
# (transformers comes with the image: 5.17 when last seen, inside the range pyproject.toml accepts)
#   OUT=/tmp/out bash tools/gpu_check.sh                           # ~6 min, at most GPU_CHECK_BUDGET_S (510)
#   OUT=/tmp/out GPU_CHECK_DEVICE=cpu PY=.venv/bin/python bash tools/gpu_check.sh   # a trial without a GPU
# Steps, each bounded by `timeout` and by what is left of the budget; a failure does not stop the next:
#   a. the carried wheels (.whl/) into /tmp/site; GPU, Python, torch, CUDA    -> env.log
#   b. the gpu-marked tests, then the engine's and the learner's unit tests  -> tests.log
#   c. bench_engine: decode steps of the 5M and 0.5B models, bfloat16, eager and CUDA graphs side
#      by side (--cuda-graphs both)                                          -> bench_engine.log
#   d. bench_learner: 0.5B, bfloat16, 1 rank, 4 groups x 8, responses 1-256, and the model
#      step of transformers against model/decoder.py                          -> bench_learner.log
#   e. launch/gpu1.toml in /tmp/gpu1: the warm start, then the whole loop     -> loop.log, actors.log
# summary.txt (also printed as it goes): each step's exit status and time, then the main figures.
# Writes under $OUT and /tmp only (no bytecode, pytest cache or hypothesis database in the repo).

set -u
: "${OUT:?set OUT to the folder for the logs}"
cd "$(dirname "$0")/.."
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PY=${PY:-python3}
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-510}))
SITE=/tmp/site
RUN=/tmp/gpu1
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}  # april up's children inherit it
export PYTHONDONTWRITEBYTECODE=1 HYPOTHESIS_STORAGE_DIRECTORY=/tmp/hypothesis
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"

if [[ $DEVICE == cpu ]]; then  # smoke sizes; the run on ports that a dev machine's own run leaves free
    ENGINE_ARGS=(--device cpu --quick --models 5M --cuda-graphs both)
    LEARNER_ARGS=(--device cpu --smoke --ranks 1)
    LOOP_ARGS=(--set generator.torch.device=cpu --set generator.torch.dtype=float32 --set learner.device=cpu
               --set learner.dtype=float32 --set run.broker_port=5655 --set run.broadcaster_port=5656
               --set run.store_port=29700)
    WARM_S=20
    LOOP_S=45
else
    ENGINE_ARGS=(--device cuda --dtype bfloat16 --models 5M 0.5B --cuda-graphs both)
    LEARNER_ARGS=(--device cuda --dtype bfloat16 --params 0.5B --ranks 1 --groups 4 --group-size 8
                  --response-len 256 --steps 3 --versus-decoder)
    LOOP_ARGS=()
    WARM_S=60
    LOOP_S=100
fi

# step NAME LIMIT_S LOG CMD...: CMD's output appended to LOG, killed after LIMIT_S or when the budget ends.
step() {
    local name=$1 limit=$2 log=$3 t0=$SECONDS rc
    shift 3
    (( limit > DEADLINE - SECONDS )) && limit=$((DEADLINE - SECONDS))
    if (( limit < 10 )); then
        echo "$name: skipped, the budget is spent" | tee -a "$SUMMARY"
        return 1
    fi
    echo "== $name (limit ${limit} s): $*" >> "$log"
    timeout -k 15 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$SUMMARY"
    return $rc
}

# a. wheels and versions
rm -rf "$SITE"
step install 60 "$OUT/env.log" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl/*.whl
step gpu 20 "$OUT/env.log" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
step versions 60 "$OUT/env.log" "$PY" -c '
import sys, blake3, jsonschema, msgspec, pydantic, structlog, zmq
print("python", sys.version.split()[0], "| pyzmq", zmq.__version__, "| msgspec", msgspec.__version__,
      "| pydantic", pydantic.VERSION, "| structlog", structlog.__version__, "| blake3", blake3.__version__)
import torch
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| available", cuda,
      "|", torch.cuda.get_device_name(0) if cuda else "no GPU")'

# b. tests (pyproject addopts add -m "not long"; a later -m replaces it)
step tests-gpu 100 "$OUT/tests.log" "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs \
    --continue-on-collection-errors tests
step tests-unit 80 "$OUT/tests.log" "$PY" -m pytest -p no:cacheprovider -q -n 8 \
    tests/unit/test_torch_engine.py tests/unit/test_decode_graphs.py tests/unit/test_learner.py \
    tests/unit/test_learner_hf.py tests/unit/test_hf_architectures.py

# c, d. benchmarks
step bench-engine 150 "$OUT/bench_engine.log" "$PY" tools/bench_engine.py "${ENGINE_ARGS[@]}"
step bench-learner 200 "$OUT/bench_learner.log" "$PY" tools/bench_learner.py "${LEARNER_ARGS[@]}"

# e. the whole loop: the warm start first (on the CPU, cut at WARM_S; april up counts it in
# run.duration_s), then the run, shortened when the budget is short; the GPU's processes are listed
# once, mid-run
rm -rf "$RUN"
UP=("$PY" -m april_async.cli up --config launch/gpu1.toml --set "run.dir=$RUN" "${LOOP_ARGS[@]}")
step warm-start $((WARM_S + 30)) "$OUT/loop.log" "${UP[@]}" --set "warmstart.max_seconds=$WARM_S" \
    --warm-start-only
duration=$(( DEADLINE - SECONDS - 70 < LOOP_S ? DEADLINE - SECONDS - 70 : LOOP_S ))
(( duration < 20 )) && duration=20
(sleep $((duration / 2 + 20)); nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv) \
    > /tmp/gpu_check_apps.txt 2>&1 &
apps=$!
step loop $((duration + 100)) "$OUT/loop.log" "${UP[@]}" --set "run.duration_s=$duration"
kill "$apps" 2>/dev/null
{
    echo "== GPU processes mid-run"; cat /tmp/gpu_check_apps.txt
    for f in "$RUN"/summary.json "$RUN"/broker_state.json "$RUN"/broadcaster.json; do
        echo "== $f"; head -c 3000 "$f"; echo
    done
    echo "== $RUN/metrics.jsonl (the last 3 of $(wc -l < "$RUN/metrics.jsonl") rows)"
    tail -n 3 "$RUN/metrics.jsonl"
    for f in "$RUN"/logs/*.log; do
        echo "== $f (last 40 lines)"; tail -n 40 "$f"
    done
} > "$OUT/actors.log" 2>&1

{
    echo "== figures"
    grep -hE '(passed|failed|errors?|skipped|deselected).* in [0-9.]+s' "$OUT/tests.log"
    grep -hE '^(torch |decode step|model |5M |0\.5B )' "$OUT/bench_engine.log"
    grep -hE '^\{"(ranks|model_step)"' "$OUT/bench_learner.log"
    grep -hE 'warm start done|april up: done' "$OUT/loop.log"
} 2>&1 | tee -a "$SUMMARY"
