# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KERNELKIT := $(VENV)/bin/kernelkit

.PHONY: demo test gpu-test clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

# The interpreter runs every Triton kernel on the CPU, so the tests need no GPU; one worker per core.
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto --dist worksteal -m "not gpu and not slow" --timeout=600 tests

test-all: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto --dist worksteal -m "not gpu" --timeout=600 tests

# The main job, in three timed steps: the ceilings (measured on a GPU, the H100 datasheet without one); every
# op checked against its float64 reference; then the built-in Llama example profiled on the roofline (measured
# on a GPU, predicted for the H100 without one), with the report written to kernelkit-report/.
# The check is `check all --quick`: one small shape per kernel path of each op, each path compiled and checked
# once (the full `kernelkit check all` compiles every shape, dtype and layout: minutes on a new machine, and
# tens of minutes in the CPU interpreter). It runs each kernel's first config (KERNELKIT_TUNE=first):
# correctness needs no tuning. The profile takes its projections from the benchmark tables instead of timing
# kernelkit's kernels at the model's shapes (--no-time-kernels: timing them compiles and tunes them first).
demo: SHELL := /bin/bash
demo: export TIMEFORMAT := (%0R s)
demo: $(VENV)/.installed
	@echo "== 1/3 kernelkit doctor: this machine's ceilings"
	@time $(KERNELKIT) doctor --gpu h100
	@echo "== 2/3 kernelkit check all --quick: every op against its float64 reference"
	@time if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  KERNELKIT_TUNE=first $(KERNELKIT) check all --quick; \
	else \
	  TRITON_INTERPRET=1 $(KERNELKIT) check all --quick --device cpu; \
	fi
	@echo "== 3/3 kernelkit profile --example llama: the model's ops on the roofline"
	@time $(KERNELKIT) profile --example llama --out kernelkit-report --top 15 --no-time-kernels

gpu-test: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info kernelkit-report
