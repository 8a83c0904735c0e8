#!/usr/bin/env bash
# The identical-loss check of a refactor (structure v3 and v4): the GPT and the VAE trained on cpu, cpu_ddp,
# cpu_fsdp, cpu_tp and cpu_pp, each run's metrics.jsonl kept without its clocks (time, speed, memory), so two trees
# compare with `diff -r`. Run it from the tree to measure:
#   scripts/same_trajectories.sh /tmp/before   (on the old commit)   scripts/same_trajectories.sh /tmp/after
#   diff -r /tmp/before /tmp/after && echo bitwise equal
set -euo pipefail
out=${1:?usage: scripts/same_trajectories.sh OUT_FOLDER}
mkdir -p "$out"
python=${PYTHON:-.venv/bin/python}
port=29610
for recipe in gpt vae; do
    for layout in cpu cpu_ddp cpu_fsdp cpu_tp cpu_pp; do
        run=$(mktemp -d)
        port=$((port + 1))
        if OMP_NUM_THREADS=1 timeout 900 "$python" -m accelerate.commands.launch --quiet --main_process_port "$port" \
            --num_cpu_threads_per_process 1 --config_file "accelerate_configs/$layout.yaml" -m accel_trainer train \
            "$recipe" "layout=accelerate_configs/$layout.yaml" max_steps=6 log_every_steps=1 eval_every_steps=3 \
            save_every_steps=0 "output_dir=$run" >"$out/$recipe-$layout.log" 2>&1; then
            # the clocks differ run to run; every other number must not
            "$python" -c '
import json, sys
for line in open(sys.argv[1]):
    record = json.loads(line)
    print(json.dumps({k: v for k, v in record.items() if not any(w in k for w in ("time", "seconds", "wait", "_s", "per_s", "mfu", "memory", "_mb", "_gb", "wall", "throughput", "tflops"))}, sort_keys=True))
' "$(find "$run" -name metrics.jsonl | head -1)" >"$out/$recipe-$layout.jsonl"
            echo "$recipe $layout: $(wc -l <"$out/$recipe-$layout.jsonl") records"
        else
            echo "$recipe $layout: refused or failed (exit $?): $(tail -1 "$out/$recipe-$layout.log")"
            tail -1 "$out/$recipe-$layout.log" >"$out/$recipe-$layout.refused"
        fi
        rm -rf "$run"
    done
done
