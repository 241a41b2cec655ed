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

# The interpreter runs every Triton kernel on the CPU, so the tests need no GPU.
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" --timeout=600 tests

demo: $(VENV)/.installed
	$(VENV)/bin/kernelkit doctor --gpu h100
	TRITON_INTERPRET=1 $(VENV)/bin/kernelkit profile --example llama --out kernelkit-report

gpu-test: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info kernelkit-report
