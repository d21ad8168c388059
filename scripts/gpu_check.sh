#!/usr/bin/env bash
# The GPU check: one prepared run on a lent H100/H200 that has no network (docs/gpu.md).
#
#   bash scripts/gpu_check.sh check   # install offline, tests/gpu, the served smoke test, the kernel sweep
#   bash scripts/gpu_check.sh bench   # install offline, bench.gpu: Qwen3-8B, then the hybrid and MoE shapes
#   bash scripts/gpu_check.sh all     # both, in that order
#   REHEARSE=1 bash scripts/gpu_check.sh all   # the same steps on this CPU machine, tiny shapes, no installs
#
# Needs, in the repo root: .gpu/ (`fp4serve bundle --out .gpu --arch sm_90a --model ...`) and .whl/
# (the cp312 wheels the GPU image lacks). Each step runs under its own time budget, in order of
# value, and a failed step does not stop the next. What comes back lies in $OUT: summary.txt (one
# line per step, then each step's tail), logs.tgz (every log and JSON) and the JSON reports.
set -u
MODE="${1:-all}"
OUT="${OUT:-/tmp/gpu-check}"
REHEARSE="${REHEARSE:-0}"
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
    note "gpu_check $MODE, $(date -u +%Y-%m-%dT%H:%MZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?'), rehearse=$REHEARSE"
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
      f"capability {torch.cuda.get_device_capability(0)}; SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
EOF
}

check() {
    # 1. tests/gpu. --noconftest: tests/conftest.py refuses to run without the whole `test` extra
    #    (selenium, vllm-router...), which these tests do not use. No JIT: a kernel the bundle
    #    lacks fails here rather than compiling for minutes.
    step tests-gpu 240 env FLASHINFER_DISABLE_JIT=1 "$PY" -m pytest tests/gpu --noconftest -p no:cacheprovider \
        -o addopts="" -q -ra --timeout 240 --junitxml="$WORK/tests-gpu.xml"
    # 2. The served smoke test: Qwen3-8B's shapes, NVFP4 at load, 64 streams, greedy against torch.
    if [ "$REHEARSE" = 1 ]; then
        step smoke 600 "$PY" -m bench.gpu_smoke --device cpu --tiny --layers 2 --streams 8 --max-tokens 16 \
            --greedy-tokens 8 --logs "$WORK" --out "$OUT/smoke.json"
    else
        step smoke 300 "$PY" -m bench.gpu_smoke --logs "$WORK" --out "$OUT/smoke.json"
    fi
    # 3. The NVFP4 matmul against the copy bandwidth at M = 1..16, best of the tile sweep.
    if [ "$REHEARSE" = 1 ]; then
        note "kernels                skipped (CUDA only; tests/test_nvfp4_matmul.py checks it under TRITON_INTERPRET)"
    else
        step kernels 150 "$PY" -m bench.kernels --sweep --m 1 2 4 8 16 --out "$OUT/kernels.json"
    fi
}

bench() {
    if [ "$REHEARSE" = 1 ]; then
        local dev=(--device cpu --tiny --layers 2 --batch-sizes 1 4 --context 64 --num-requests 4 --input-len 32
                   --output-len 8 --reps 3)
        step bench-qwen3-8b 600 "$PY" -m bench.gpu "${dev[@]}" --out "$OUT/bench-qwen3-8b.json"
        step bench-hybrid 600 "$PY" -m bench.gpu --shape qwen3.6-27b --formats nvfp4 "${dev[@]}" \
            --out "$OUT/bench-hybrid.json"
        step bench-moe 600 "$PY" -m bench.gpu --shape qwen3-coder-30b-a3b --formats nvfp4 "${dev[@]}" \
            --out "$OUT/bench-moe.json"
        return 0
    fi
    # 4. Qwen3-8B (36 layers): decode step time at batch 1/16/64/256 with 1k context against the HBM
    #    floor, bf16 and NVFP4; 64 x 1000-in/1000-out; transformers' generate on the same workload.
    step bench-qwen3-8b 260 "$PY" -m bench.gpu --out "$OUT/bench-qwen3-8b.json"
    # 5. The hybrid (Qwen3.6-27B) and MoE (Qwen3-Coder-30B-A3B) shapes, 4 layers each, NVFP4.
    step bench-hybrid 110 "$PY" -m bench.gpu --shape qwen3.6-27b --layers 4 --formats nvfp4 \
        --batch-sizes 1 16 64 --output-len 200 --skip-transformers --out "$OUT/bench-hybrid.json"
    step bench-moe 110 "$PY" -m bench.gpu --shape qwen3-coder-30b-a3b --layers 4 --formats nvfp4 \
        --batch-sizes 1 16 64 --output-len 200 --skip-transformers --out "$OUT/bench-moe.json"
}

setup
case "$MODE" in
    check) check ;;
    bench) bench ;;
    all) check; bench ;;
    *) echo "usage: gpu_check.sh check|bench|all" >&2; exit 2 ;;
esac
note "total $(( $(date +%s) - T0 ))s"
# At most 8 files come back from the device: the summary, the JSON reports and one archive of the rest.
tar -czf "$OUT/logs.tgz" -C "$WORK" . 2>/dev/null
rm -rf "$WORK"
cat "$SUMMARY"
