# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test gpu-test clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

# The interpreter runs every Triton kernel on the CPU, so the tests need no GPU; one worker per core.
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto -m "not gpu" --timeout=600 tests

# The main job: the ceilings (measured on a GPU, the H100 datasheet without one); every op checked
# against its float64 reference; then the built-in Llama example profiled on the roofline (measured on
# a GPU, predicted for the H100 without one), with the report written to kernelkit-report/.
# The check runs each kernel's first config (KERNELKIT_TUNE=first): correctness needs no tuning, and
# tuning every config of every op and shape on a new machine takes minutes (bench and profile tune).
demo: $(VENV)/.installed
	$(VENV)/bin/kernelkit doctor --gpu h100
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
	  && KERNELKIT_TUNE=first $(VENV)/bin/kernelkit check all \
	  || TRITON_INTERPRET=1 $(VENV)/bin/kernelkit check all --device cpu --trials 1
	$(VENV)/bin/kernelkit profile --example llama --out kernelkit-report --top 15

gpu-test: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info kernelkit-report
