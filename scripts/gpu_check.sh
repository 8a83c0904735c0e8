#!/usr/bin/env bash
# Every CUDA path in one call on a lent GPU machine (no internet there; its image has torch, accelerate,
# transformers, peft, pytest). datasets, its two missing needs and torchao travel as wheels in .whl/ (docs/gpu.md).
#   scripts/gpu_check.sh            # on the GPU machine, from the repository root; logs go to $OUT or /tmp
#   GPU_CHECK_MFU=0 scripts/gpu_check.sh -k fp8   # the tests alone; more arguments go to pytest
#   GPU_CHECK_FIRST="fp8 or qlora" scripts/gpu_check.sh   # these tests before anything else (the newest paths)
# Order: GPU_CHECK_FIRST's tests, the MFU variants alone on the GPU (timings), the other tests in parallel, a user's run.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, accelerate, datasets, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'accelerate', accelerate.__version__, 'datasets', datasets.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/env.txt"

# the GPU tests: the CUDA paths, and the non-finite guard's late verdict on CUDA (GPU_CHECK_FIRST=late_verdict: those first)
TESTS=(python3 -m pytest -q -p no:cacheprovider -m gpu tests/layouts/test_gpu.py
       tests/unit/stopping/test_nonfinite_late_verdict.py -rA --durations=0)
FIRST=${GPU_CHECK_FIRST:-}
if [ -n "$FIRST" ]; then
    echo "== the GPU tests first: $FIRST"
    "${TESTS[@]}" -k "$FIRST" 2>&1 | tee "$OUT/gpu_tests_first.log"
fi

if [ "${GPU_CHECK_MFU:-1}" = 1 ]; then
    echo "== GPT-2 small MFU (benchmarks/gpt_mfu.py), one variant a line" | tee "$OUT/mfu.md"
    for extra in "" "num_dataloader_workers=4 num_prefetch_batches=2" \
        "num_dataloader_workers=4 num_prefetch_batches=2 skip_nonfinite_steps=false" \
        "num_dataloader_workers=4 num_prefetch_batches=2 mixed_precision=fp8"; do
        # shellcheck disable=SC2086  # the variant's overrides are separate words
        timeout 110 python3 benchmarks/gpt_mfu.py --micro_batch_size 32 --extra $extra 2>&1 | tail -n 1 | tee -a "$OUT/mfu.md"
    done
fi

echo "== the GPU tests"
"${TESTS[@]}" -n 6 ${FIRST:+-k "not ($FIRST)"} "$@" 2>&1 | tee "$OUT/gpu_tests.log"

echo "== make train-gpu, as a user sees it (VAE, bf16, 1 GPU)"
"$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))')/accelerate" launch --config_file accelerate_configs/gpu.yaml -m accel_trainer train vae \
    output_dir=/tmp/gpu_vae max_steps=300 show_progress_bar=false 2>&1 | tee "$OUT/train_gpu.log" | tail -n 15
