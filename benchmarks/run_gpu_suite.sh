#!/usr/bin/env bash
# One command for a GPU machine: the GPU tests, a trimmed benchmark (bf16, head dims 64 and 128, causal and
# not, N = 2k and 8k), then the loop-profile estimate of the same kernels next to the measured numbers, within
# 6 minutes on an H200 (each part's timeout is capped by what is left of SUITE_SECONDS, default 350), then the
# variant rows (benchmarks/bench_gpu_variants.py) and the decode rows (benchmarks/bench_decode.py). The GPU
# tests include the CUDA-graph captures (tests/triton/test_triton_cuda_graph.py); the benchmark has rows for
# the default forward and backward (triton), the forward without warp specialisation (triton-nows) and the
# deterministic backward (triton-det) where this checkout has them. Outputs, kept
# few: iomodel.txt, gpu-tests.{log,xml} (or gpu-checks.log), bench.log, bench/, variants.log, variants/,
# decode.log, decode/, loops.txt, schedule.txt, estimates.txt (the loop profile's estimates beside the measured
# TFLOP/s), under $OUT when
# it is set, else under benchmarks/results/local/ (untracked; copy what you commit to benchmarks/results/gpu/).
# Needs only python3 with torch and triton: no network, no pip install. Triton compiles each kernel once per
# machine (its cache is shared by the tests, the benchmark and the loop profile's runs).
# pytest, hypothesis and matplotlib are used when present; without pytest the same GPU checks run through
# benchmarks/gpu_checks.py. Without CUDA it says so, prints the IO model and the benchmark grid's modelled
# traffic, and exits 0.
#
#   bash benchmarks/run_gpu_suite.sh
#   OUT=/some/dir PYTHON=python3 SUITE_SECONDS=350 GPU_TESTS_TIMEOUT=170 BENCH_TIMEOUT=150 VARIANTS_TIMEOUT=90 \
#       DECODE_TIMEOUT=75 LOOPS_TIMEOUT=90 SCHEDULE_TIMEOUT=45 bash benchmarks/run_gpu_suite.sh
#
# Exit status: 0 when every part that ran succeeded; 1 if the GPU tests failed; 2 if the benchmark failed.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-benchmarks/results/local}"
mkdir -p "$OUT_DIR"
status=0

if ! "$PY" -c "import flashattn_teach" 2>/dev/null; then
    export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
    echo "flashattn_teach is not installed: using PYTHONPATH=$PYTHONPATH"
fi
has() { "$PY" -c "import $1" 2>/dev/null; }
# seconds for a part: its own limit, or what is left of the suite's, whichever is smaller (at least 10)
budget() {
    local left=$(( ${SUITE_SECONDS:-350} - SECONDS ))
    [ "$left" -lt "$1" ] && echo $(( left > 10 ? left : 10 )) || echo "$1"
}

# The block-scheduler simulation of the benchmark's causal shapes per grid order (docs/loop-profile.md, Grid order); it
# compiles the kernels for their occupancy and needs no GPU. Not counted in the exit status.
schedule() {
    if "$PY" -m flashattn_teach.cli kernels --help 2>/dev/null | grep -q -- "--schedule"; then
        echo "== Grid-order simulation (flashattn-teach kernels --arch sm90 --schedule)"
        timeout "$(budget "${SCHEDULE_TIMEOUT:-45}")" "$PY" -m flashattn_teach.cli kernels --arch sm90 --schedule \
            >"$OUT_DIR/schedule.txt" 2>&1
        local rc=$?
        grep -v -i "warn" "$OUT_DIR/schedule.txt"
        [ "$rc" -ne 0 ] && echo "schedule simulation: exit $rc (124 is a timeout; see $OUT_DIR/schedule.txt)"
    else
        echo "== Grid-order simulation: this checkout's 'flashattn-teach kernels' has no --schedule; skipped"
    fi
    return 0
}

echo "== IO model (N = 8192, d = 128, 228 KiB on chip)"
"$PY" - <<'EOF' | tee "$OUT_DIR/iomodel.txt"
import argparse
from flashattn_teach import iomodel
parser = argparse.ArgumentParser()
iomodel.add_arguments(parser)
iomodel.run(parser.parse_args(["--seq-len", "8192", "--head-dim", "128", "--sram-kib", "228"]))
EOF

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "== CUDA is absent (torch.cuda.is_available() is False): GPU tests skipped"
    "$PY" benchmarks/bench_attention.py --trimmed --out "$OUT_DIR/bench"
    "$PY" benchmarks/bench_gpu_variants.py --out "$OUT_DIR/variants"
    schedule
    exit 0
fi

if has pytest; then
    echo "== GPU tests (pytest -m gpu tests/)"
    extra=()
    no_hypothesis=0
    if ! has hypothesis; then
        no_hypothesis=1
        # tests/conftest.py and the property-test modules import hypothesis: run without the conftest and
        # let the modules that need hypothesis fail to collect; judge by the failed/passed counts only.
        echo "hypothesis is not installed: running without tests/conftest.py; modules that need it are not collected"
        extra=(--noconftest --continue-on-collection-errors)
    fi
    if has xdist; then
        # Triton compiles each kernel specialisation on first launch, one at a time per process: spread the
        # ~100 compilations over worker processes (each with its own CUDA context) on the machine's cores.
        extra+=(-n "${GPU_TEST_WORKERS:-8}")
    fi
    timeout "$(budget "${GPU_TESTS_TIMEOUT:-170}")" "$PY" -m pytest -m gpu tests/ -q -p no:cacheprovider "${extra[@]}" \
        --junitxml="$OUT_DIR/gpu-tests.xml" 2>&1 | tee "$OUT_DIR/gpu-tests.log"
    rc=${PIPESTATUS[0]}
    # pytest: 5 means no test was selected; 124 is timeout's.
    if [ "$no_hypothesis" -eq 1 ] && [ "$rc" -ne 124 ]; then
        # a run that ran nothing, or ended in errors (a module that failed to import), fails too
        if tail -n 1 "$OUT_DIR/gpu-tests.log" | grep -qE " (failed|errors?)\b" ||
            ! tail -n 1 "$OUT_DIR/gpu-tests.log" | grep -q " passed"; then rc=1; else rc=0; fi
    fi
    [ "$rc" -eq 5 ] && rc=0
    tests_log="$OUT_DIR/gpu-tests.log"
else
    echo "== GPU checks (pytest is not installed: benchmarks/gpu_checks.py runs the same cases)"
    timeout "$(budget "${GPU_TESTS_TIMEOUT:-170}")" "$PY" benchmarks/gpu_checks.py 2>&1 | tee "$OUT_DIR/gpu-checks.log"
    rc=${PIPESTATUS[0]}
    tests_log="$OUT_DIR/gpu-checks.log"
fi
if [ "$rc" -ne 0 ]; then
    echo "GPU tests: FAILED (exit $rc; 124 is a timeout)"
    status=1
fi

echo "== Trimmed GPU benchmark"
has matplotlib || echo "matplotlib is not installed: no plots"
timeout "$(budget "${BENCH_TIMEOUT:-150}")" "$PY" benchmarks/bench_attention.py --trimmed --warmup 10 --rep 50 \
    --out "$OUT_DIR/bench" 2>&1 | tee "$OUT_DIR/bench.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    echo "benchmark: FAILED (exit $rc; rows of finished cells are in $OUT_DIR/bench/attention.csv)"
    [ "$status" -eq 0 ] && status=2
fi

# Variant rows (window, softcap, seqlens_k, varlen, fp8: ours, SDPA with the dense mask, FlexAttention). Every row
# fails soft inside the script; a timeout keeps the rows written so far. Not counted in the exit status.
echo "== Variant rows (window, softcap, seqlens_k, varlen, fp8)"
timeout "$(budget "${VARIANTS_TIMEOUT:-90}")" "$PY" benchmarks/bench_gpu_variants.py --out "$OUT_DIR/variants" \
    2>&1 | tee "$OUT_DIR/variants.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && echo "variant rows: exit $rc (124 is a timeout; rows so far in $OUT_DIR/variants/variants.csv)"

# Decode rows (one step against a KV cache, batch 1-64, cache 1k-128k: ours with the chosen and with one split,
# SDPA without and with a key-padding mask). Fail soft like the variant rows; not counted in the exit status.
echo "== Decode rows (flash_attention_with_kvcache vs SDPA)"
timeout "$(budget "${DECODE_TIMEOUT:-75}")" "$PY" benchmarks/bench_decode.py --out "$OUT_DIR/decode" \
    2>&1 | tee "$OUT_DIR/decode.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && echo "decode rows: exit $rc (124 is a timeout; rows so far in $OUT_DIR/decode/decode.csv)"

# The loop profile's estimate of the benchmarked kernels, next to their measured TFLOP/s: what calibrates it.
if "$PY" -m flashattn_teach.cli kernels --help 2>/dev/null | grep -q -- "--loops"; then
    echo "== Loop-profile estimate (flashattn-teach kernels --arch sm90 --loops)"
    timeout "$(budget "${LOOPS_TIMEOUT:-90}")" "$PY" -m flashattn_teach.cli kernels --arch sm90 --loops \
        --dtype bfloat16 --head-dim 64 128 >"$OUT_DIR/loops.txt" 2>&1
    rc=$?
    tail -n 40 "$OUT_DIR/loops.txt"
    [ "$rc" -ne 0 ] && echo "loop profile: exit $rc (not counted as a failure; see $OUT_DIR/loops.txt)"
else
    echo "== Loop profile: this checkout's 'flashattn-teach kernels' has no --loops; skipped"
fi
# The estimates next to the measurements: the loop profile's per-pass TFLOP/s (non-causal) and the benchmark's
# triton rows of the same passes at N = 8192, not causal, where a launch's tail matters least.
if [ -s "$OUT_DIR/loops.txt" ] && [ -s "$OUT_DIR/bench/attention.csv" ]; then
    "$PY" benchmarks/estimates.py "$OUT_DIR/loops.txt" "$OUT_DIR/bench/attention.csv" | tee "$OUT_DIR/estimates.txt"
fi
schedule
echo "GPU tests: $(tail -n 1 "$tests_log")"
echo "suite: ${SECONDS} s"
exit "$status"
