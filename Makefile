# Two entry points that work on a fresh machine: `make demo` and `make test`.
# torch is installed first, pinned, so a CPU machine takes the local CPU wheel instead of letting
# a bare dependency resolve to a multi-GB CUDA build; override TORCH_SPEC on a GPU machine if needed.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fastgen-installed

.PHONY: setup demo test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,serving]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) .pytest_cache
