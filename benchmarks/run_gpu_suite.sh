#!/usr/bin/env bash
# One command for a GPU machine. First the first light (benchmarks/first_light.py: every case group of the
# default paths' correctness in its own process with a timeout, so a hang is HANG and a crash ERROR and the
# rest still runs, then the headline timings; it plans 267 s and is cut at FIRST_LIGHT_TIMEOUT, default 290),
# then, while SUITE_SECONDS (default 300, the GPU time of a short slot) leaves at least MIN_PART_SECONDS (30)
# for a part: the kernel trace (benchmarks/gpu_trace.py), the GPU tests, a trimmed benchmark (bf16, head dims 64
# and 128, causal and not, N = 2k and 8k),
# the variant rows (benchmarks/bench_gpu_variants.py) and the decode rows (benchmarks/bench_decode.py). A longer
# slot runs them all: SUITE_SECONDS=900 bash benchmarks/run_gpu_suite.sh.
#
# Not here, because they need no GPU: the loop profile and the grid-order simulation compile the kernels ahead
# of time for sm_90 and run on any machine with triton installed:
#     flashattn-teach kernels --arch sm90 --loops --dtype bfloat16 --head-dim 64 128 > loops.txt
#     flashattn-teach kernels --arch sm90 --schedule > schedule.txt
# and the loop profile's estimates beside a GPU run's measured TFLOP/s (also on any machine, afterwards):
#     python benchmarks/estimates.py loops.txt benchmarks/results/gpu/<run>/bench/attention.csv
#
# Outputs, under $OUT when it is set, else under benchmarks/results/local/ (untracked; copy what you commit to
# benchmarks/results/gpu/): first-light/ (first-light.json, first-light.txt), first-light.log, trace/, trace.log,
# gpu-tests.{log,xml} (or gpu-checks.log), bench.log, bench/, variants.log, variants/, decode.log, decode/.
# Needs only python3 with torch and triton: no network, no pip install. Triton compiles each kernel once per
# machine (its on-disk cache is shared by the first light's precompile, the tests and the benchmarks).
# pytest, hypothesis and matplotlib are used when present; without pytest the same GPU checks run through
# benchmarks/gpu_checks.py. Without CUDA it says so, prints the IO model, the first light's plan and the
# benchmark grid's modelled traffic, and exits 0.
#
#   bash benchmarks/run_gpu_suite.sh
#   OUT=/some/dir PYTHON=python3 SUITE_SECONDS=300 FIRST_LIGHT_TIMEOUT=290 GPU_TESTS_TIMEOUT=170 \
#       BENCH_TIMEOUT=150 VARIANTS_TIMEOUT=90 DECODE_TIMEOUT=75 bash benchmarks/run_gpu_suite.sh
#
# Exit status: 0 when every part that ran succeeded; 1 if the first light found a fault (FAIL, ERROR or HANG)
# or the GPU tests failed; 2 if the benchmark failed.
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
# seconds for a part: its own limit, or what is left of the suite's, whichever is smaller
budget() {
    local left=$(( ${SUITE_SECONDS:-300} - SECONDS ))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
# whether a part may start: at least MIN_PART_SECONDS of the suite's time left; else say how to run it
room() {
    local left=$(( ${SUITE_SECONDS:-300} - SECONDS ))
    if [ "$left" -lt "${MIN_PART_SECONDS:-30}" ]; then
        echo "== $1: skipped, ${left} s of SUITE_SECONDS=${SUITE_SECONDS:-300} left (a longer slot: SUITE_SECONDS=900)"
        return 1
    fi
    return 0
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "== CUDA is absent (torch.cuda.is_available() is False): GPU tests skipped"
    echo "== IO model (N = 8192, d = 128, 228 KiB on chip)"
    "$PY" - <<'EOF' | tee "$OUT_DIR/iomodel.txt"
import argparse
from flashattn_teach.tools import iomodel
parser = argparse.ArgumentParser()
iomodel.add_arguments(parser)
iomodel.run(parser.parse_args(["--seq-len", "8192", "--head-dim", "128", "--sram-kib", "228"]))
EOF
    echo "== First light: the plan (python benchmarks/first_light.py --dry-run)"
    "$PY" benchmarks/first_light.py --dry-run
    "$PY" benchmarks/bench_attention.py --trimmed --out "$OUT_DIR/bench"
    "$PY" benchmarks/bench_gpu_variants.py --out "$OUT_DIR/variants"
    exit 0
fi

echo "== First light (benchmarks/first_light.py)"
timeout "$(budget "${FIRST_LIGHT_TIMEOUT:-290}")" "$PY" benchmarks/first_light.py --out "$OUT_DIR/first-light" 2>&1 |
    tee "$OUT_DIR/first-light.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    echo "first light: exit $rc (1: a FAIL, ERROR or HANG, listed above; 124: cut by its timeout)"
    status=1
fi

# The kernel's own numbers (benchmarks/gpu_trace.py): the teaching example scaled to the kernel's smallest tile,
# traced in bf16, its JSON and tables for readers without a GPU (issue 39). Seconds; not counted in the exit status.
if room "Kernel trace"; then
    echo "== Kernel trace (benchmarks/gpu_trace.py: the trace build's numbers beside the reference's, bf16)"
    timeout "$(budget "${TRACE_TIMEOUT:-60}")" "$PY" benchmarks/gpu_trace.py --out "$OUT_DIR/trace" 2>&1 |
        tee "$OUT_DIR/trace.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && echo "kernel trace: exit $rc (124 is a timeout; each case's error is in $OUT_DIR/trace.log)"
fi

# The GPU tests (pytest -m gpu), or the same checks without pytest. Counted in the exit status.
tests_log=""
gpu_tests() {
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
}
room "GPU tests" && gpu_tests

# The trimmed benchmark: bench_attention.py --trimmed, every provider. Counted in the exit status.
trimmed_benchmark() {
    echo "== Trimmed GPU benchmark"
    has matplotlib || echo "matplotlib is not installed: no plots"
    timeout "$(budget "${BENCH_TIMEOUT:-150}")" "$PY" benchmarks/bench_attention.py --trimmed --warmup 10 --rep 50 \
        --out "$OUT_DIR/bench" 2>&1 | tee "$OUT_DIR/bench.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "benchmark: FAILED (exit $rc; rows of finished cells are in $OUT_DIR/bench/attention.csv)"
        [ "$status" -eq 0 ] && status=2
    fi
}
room "Trimmed GPU benchmark" && trimmed_benchmark

# Variant rows (window, softcap, seqlens_k, varlen, fp8: ours, SDPA with the dense mask, FlexAttention). Every row
# fails soft inside the script; a timeout keeps the rows written so far. Not counted in the exit status.
if room "Variant rows"; then
    echo "== Variant rows (window, softcap, seqlens_k, varlen, fp8)"
    timeout "$(budget "${VARIANTS_TIMEOUT:-90}")" "$PY" benchmarks/bench_gpu_variants.py --out "$OUT_DIR/variants" \
        2>&1 | tee "$OUT_DIR/variants.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && echo "variant rows: exit $rc (124 is a timeout; rows so far in $OUT_DIR/variants/variants.csv)"
fi

# Decode rows (one step against a KV cache, batch 1-64, cache 1k-128k: ours with the chosen and with one split,
# SDPA without and with a key-padding mask). Fail soft like the variant rows; not counted in the exit status.
if room "Decode rows"; then
    echo "== Decode rows (flash_attention_with_kvcache vs SDPA)"
    timeout "$(budget "${DECODE_TIMEOUT:-75}")" "$PY" benchmarks/bench_decode.py --out "$OUT_DIR/decode" \
        2>&1 | tee "$OUT_DIR/decode.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && echo "decode rows: exit $rc (124 is a timeout; rows so far in $OUT_DIR/decode/decode.csv)"
fi

[ -n "$tests_log" ] && echo "GPU tests: $(tail -n 1 "$tests_log")"
echo "suite: ${SECONDS} s"
exit "$status"
