#!/usr/bin/env bash
# Every CUDA path in one call on a lent GPU machine (no internet there; its image has torch, accelerate,
# transformers, pytest). datasets and its two missing needs travel as wheels in .whl/ (see docs/gpu.md).
#   scripts/gpu_check.sh            # on the GPU machine, from the repository root; logs go to $OUT or /tmp
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

echo "== the GPU tests"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/layouts/test_gpu.py -n 3 -rA --durations=0 "$@" 2>&1 | tee "$OUT/gpu_tests.log"

echo "== make train-gpu, as a user sees it (VAE, bf16, 1 GPU)"
"$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))')/accelerate" launch --config_file accelerate_configs/gpu.yaml -m accel_trainer train vae \
    output_dir=/tmp/gpu_vae max_steps=300 show_progress_bar=false 2>&1 | tee "$OUT/train_gpu.log" | tail -n 15
