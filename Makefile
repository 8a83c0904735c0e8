# accel-trainer: two commands from a fresh clone, `make train` and `make test`.
# Every target installs first (once) into .venv. torch is pinned to a CPU build; CUDA users override it:
#   make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
TORCH ?= torch==2.13.0
RECIPE ?= vae
ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
LAUNCH_FLAGS ?=
LAUNCH := $(BIN)/accelerate launch --quiet $(LAUNCH_FLAGS)
RUN_RECIPE := -m accel_trainer train $(RECIPE) $(ARGS)

.PHONY: install train train-cpu-ddp train-gpu train-4gpu train-8gpu test bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

train: install  ## the default recipe on the default layout: 1 CPU process
	$(LAUNCH) --config_file accelerate_configs/cpu.yaml $(RUN_RECIPE)

train-cpu-ddp: install  ## 2 gloo processes on the CPU
	$(LAUNCH) --config_file accelerate_configs/cpu_ddp.yaml $(RUN_RECIPE)

train-gpu: install
	$(LAUNCH) --config_file accelerate_configs/gpu.yaml $(RUN_RECIPE)

train-4gpu: install
	$(LAUNCH) --config_file accelerate_configs/4gpu_ddp.yaml $(RUN_RECIPE)

train-8gpu: install
	$(LAUNCH) --config_file accelerate_configs/8gpu_ddp.yaml $(RUN_RECIPE)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/overhead.py

lint: install
	$(BIN)/ruff check accel_trainer recipes tests benchmarks
	$(BIN)/ruff format --check accel_trainer recipes tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) outputs .pytest_cache
