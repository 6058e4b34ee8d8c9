#!/usr/bin/env bash
# The checks for a lent GPU machine, in one go (under 10 minutes): the CUDA tests, then benchmarks.gpu (8B shape,
# bf16, 2 peers on the one device). Logs and the JSON go under $OUT (or /tmp/gpu-check). Python packages the
# machine's image lacks travel as wheels in .whl/ (installed into /tmp/site; see docs/figures.md's GPU section).
set -o pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpc', grpc.__version__)" \
    | tee -a "$OUT/device.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider -m cuda tests/cuda/test_gpu_path.py \
    tests/unit/swarm/codec/test_int8_hadamard.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -8
timeout "${BENCH_TIMEOUT_S:-420}" python3 -m benchmarks.gpu --sessions 1 32 128 --new-tokens 32 \
    2>"$OUT/gpu_bench.err" | tee "$OUT/gpu.json"
grep -v "Writing model shards\|Loading weights" "$OUT/gpu_bench.err" | tail -15
