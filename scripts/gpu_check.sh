#!/usr/bin/env bash
# The GPU check: one prepared run on a lent H100/H200 that has no network (docs/gpu.md).
#
#   bash scripts/gpu_check.sh [STEP ...]        # default: the GPU targets' steps, in order of value, in 9 minutes
#   DEADLINE_S=900 bash scripts/gpu_check.sh    # skip steps that would not end by then (default 540 s)
#   REHEARSE=1 bash scripts/gpu_check.sh        # the same steps on this CPU machine: tiny shapes, no installs
#
# Steps: tests (tests/gpu), smoke (bench.gpu_smoke: the served smoke test), bench-8b (bench.gpu on
# Qwen3-8B's shapes), kernels (bench.kernels --sweep), bench-hybrid and bench-moe (bench.gpu on
# Qwen3.6-27B's and Qwen3-Coder-30B-A3B's shapes, 4 layers, NVFP4), targets (bench.gpu_targets: the
# verdict of the JSON reports against the GPU targets; always runs, in a second). smoke is not in
# the default list: name it to run it.
#
# Needs, in the repo root: .gpu/ (`fp4serve bundle --out .gpu --arch sm_90a --model ...`) and .whl/
# (the cp312 wheels the GPU image lacks). Each step runs under its own time budget, and a failed
# step does not stop the next. What comes back lies in $OUT: summary.txt (one line per step),
# logs.tgz (every log) and the JSON reports.
set -u
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(kernels bench-8b bench-hybrid bench-moe tests)
OUT="${OUT:-/tmp/gpu-check}"
REHEARSE="${REHEARSE:-0}"
# The device run fits 9 minutes; a rehearsal on 2 CPU cores runs every step whatever it takes.
if [ "$REHEARSE" = 1 ]; then DEADLINE_S="${DEADLINE_S:-100000}"; else DEADLINE_S="${DEADLINE_S:-540}"; fi
PY="${PYTHON:-python3}"
WORK="$OUT/work"
mkdir -p "$WORK"
SUMMARY="$OUT/summary.txt"
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FP4SERVE_CACHE="/tmp/fp4serve-cache"
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME BUDGET_S COMMAND...: run under `timeout`, log to $WORK/NAME.log, one summary line.
step() {
    local name="$1" budget="$2"; shift 2
    local start=$(date +%s)
    local left=$(( DEADLINE_S - (start - T0) - 15 ))
    if [ "$left" -lt 45 ]; then
        note "$(printf '%-22s %-9s (%ss left before the deadline)' "$name" "SKIPPED" "$left")"
        return 0
    fi
    [ "$budget" -gt "$left" ] && budget=$left
    echo "== $name (budget ${budget}s, at +$((start - T0))s)" >&2
    timeout -k 15 "$budget" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    local verdict="ok"
    [ $rc -ne 0 ] && verdict="FAILED"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT"
    note "$(printf '%-22s %-9s rc=%-3s %4ss' "$name" "$verdict" "$rc" "$(( $(date +%s) - start ))")"
    tail -n 30 "$WORK/$name.log" >&2
    return 0
}

setup() {
    note "gpu_check ${STEPS[*]}, $(date -u +%Y-%m-%dT%H:%MZ), rehearse=$REHEARSE"
    if [ "$REHEARSE" = 1 ]; then
        return 0
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv >"$WORK/nvidia-smi.txt" 2>&1
    note "$(tail -n 1 "$WORK/nvidia-smi.txt")"
    # The wheels first (pure Python and cp312 binaries the image lacks), then FlashInfer from the bundle.
    step install-wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
    step install-bundle 120 env PYTHON="$PY" bash .gpu/install.sh
    "$PY" - >>"$SUMMARY" 2>&1 <<'EOF'
import importlib.metadata as md, torch
names = ["torch", "triton", "transformers", "flashinfer-python", "apache-tvm-ffi", "fla-core", "xgrammar", "openai"]
vers = []
for n in names:
    try:
        vers.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        vers.append(f"{n} MISSING")
print("versions: " + ", ".join(vers) + f"; cuda {torch.version.cuda}; device {torch.cuda.get_device_name(0)}; "
      f"capability {torch.cuda.get_device_capability(0)}; SMs {torch.cuda.get_device_properties(0).multi_processor_count}; "
      f"torch has the DLPack C exchange API: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}")
EOF
}

run_tests() {
    # --noconftest: tests/conftest.py refuses to run without the whole `test` extra (selenium,
    # vllm-router...), which these tests do not use. No JIT: a kernel the bundle lacks fails here
    # rather than compiling for minutes.
    step tests-gpu 120 env FLASHINFER_DISABLE_JIT=1 "$PY" -m pytest tests/gpu --noconftest -p no:cacheprovider \
        -o addopts="" -q -ra --timeout 240 --junitxml="$WORK/tests-gpu.xml"
    note "  $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$WORK/tests-gpu.log" | tail -n 1)"
}

run_smoke() {
    # Qwen3-8B's shapes, NVFP4 at load, 64 streams through the OpenAI SDK, greedy against torch.
    if [ "$REHEARSE" = 1 ]; then
        step smoke 600 "$PY" -m bench.gpu_smoke --device cpu --tiny --layers 2 --streams 8 --max-tokens 16 \
            --greedy-tokens 8 --logs "$WORK" --out "$OUT/smoke.json"
    else
        step smoke 240 "$PY" -m bench.gpu_smoke --layers 8 --logs "$WORK" --out "$OUT/smoke.json"
    fi
    note "  $(grep -E '^(PASS|FAIL)' "$WORK/smoke.log" | tail -n 1)"
    pkill -f "api.cli serve" 2>/dev/null || true  # a timed-out run must not leave a server holding GPU memory
}

run_kernels() {
    # The NVFP4 linear against cuBLAS bf16 and the copy bandwidth: M = 1, 16, 64, 256 on Qwen3-8B's and
    # Qwen3.6-27B's linears, each path of the dispatch, a few neighbouring tiles, pass/fail per target.
    # The rehearsal: the same code interpreted (TRITON_INTERPRET=1) on two shapes cut down (--tiny).
    if [ "$REHEARSE" = 1 ]; then
        step kernels 600 "$PY" -m bench.kernels --device cpu --tiny --sweep --sweep-budget-s 600 --shapes 8b/o 27b/down \
            --out "$OUT/kernels.json"
    else
        step kernels 100 "$PY" -m bench.kernels --sweep --sweep-budget-s 45 --out "$OUT/kernels.json"
    fi
    note "  $(grep -E 'points meet their target' "$WORK/kernels.log" | tail -n 1)"
}

# bench.gpu NAME BUDGET ARGS...: on CPU the same code on the tiny shapes, small sizes.
run_bench() {
    local name="$1" budget="$2"; shift 2
    if [ "$REHEARSE" = 1 ]; then
        # The device flags first, then the rehearsal's small sizes over them (argparse keeps the last).
        step "$name" 600 "$PY" -m bench.gpu "$@" --device cpu --tiny --layers 4 --batch-sizes 1 4 --context 64 \
            --num-requests 4 --input-len 32 --output-len 8 --reps 3 --skip-transformers --out "$OUT/$name.json"
    else
        step "$name" "$budget" "$PY" -m bench.gpu "$@" --out "$OUT/$name.json"
    fi
}

setup
for s in "${STEPS[@]}"; do
    case "$s" in
        tests) run_tests ;;
        smoke) run_smoke ;;
        kernels) run_kernels ;;
        # Qwen3-8B (36 layers): decode step time (and the 3-draft verify step at batch <= 16) at batch
        # 1/16/64 with 1k context against the HBM floor, bf16 and NVFP4, graphs; 64 x 1000-in/500-out
        # through the engine (transformers' peer only when named: bench-8b-peer).
        bench-8b) run_bench bench-8b 180 --output-len 500 --batch-sizes 1 16 64 --reps 10 --skip-transformers ;;
        bench-8b-peer) run_bench bench-8b-peer 270 --output-len 500 ;;
        # The hybrid (Qwen3.6-27B) and MoE (Qwen3-Coder-30B-A3B) shapes, 4 layers each, NVFP4.
        bench-hybrid) run_bench bench-hybrid 80 --shape qwen3.6-27b --layers 4 --formats nvfp4 \
            --batch-sizes 1 16 64 --output-len 256 --reps 10 --skip-transformers ;;
        bench-moe) run_bench bench-moe 60 --shape qwen3-coder-30b-a3b --layers 4 --formats nvfp4 \
            --batch-sizes 1 16 64 --output-len 256 --reps 10 --skip-transformers ;;
        targets) ;;
        *) note "unknown step '$s' (kernels bench-8b bench-8b-peer bench-hybrid bench-moe tests smoke targets)" ;;
    esac
done
# The verdict of whatever reports exist, against the GPU targets (never skipped: it reads files).
"$PY" -m bench.gpu_targets "$OUT" >"$WORK/targets.log" 2>&1
tail -n 1 "$WORK/targets.log" | tee -a "$SUMMARY"
cat "$WORK/targets.log" >&2
note "total $(( $(date +%s) - T0 ))s"
# At most 8 files come back from the device: the summary, the JSON reports and one archive of the rest.
tar -czf "$OUT/logs.tgz" -C "$WORK" . 2>/dev/null
rm -rf "$WORK"
cat "$SUMMARY"
