# The two commands of the README: `make demo` and `make test`. Each builds .venv/ first if needed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The torch release kernelgraft is tested with on CPU machines; override for another build, e.g.
#   make test TORCH_SPEC='torch>=2.6'
TORCH_SPEC ?= torch==2.13.0
# test processes (pytest-xdist): the default suite takes about 20-25 min in two on a 2-core machine
TEST_WORKERS ?= 2
# The GPU tests in two tiers, each part fitting a 10-minute command on one GPU. gpu-test: every test
# marked gpu once, the default hypothesis profile, GPU_WORKERS pytest processes sharing the GPU.
GPU_WORKERS ?= 4
# gpu-test-thorough PART=K (or K/N): the thorough profile's 200 cases per spelling, the K-th of
# THOROUGH_PARTS parts, THOROUGH_JOBS spellings at once, the part ended by THOROUGH_BUDGET seconds
THOROUGH_PARTS ?= 4
THOROUGH_JOBS ?= 6
THOROUGH_BUDGET ?= 520
# each run's JSON record ({date}: the day it started; {part}: K-of-N); GPU_RECORDS=DIR writes them
# elsewhere, e.g. into a folder that comes back from a GPU host
GPU_RECORDS ?= benchmarks/results/gpu_tests
GPU_RECORD ?= $(GPU_RECORDS)/{date}-gpu-test$(if $(PART),-$(subst /,-of-,$(PART))).json
THOROUGH_RECORD ?= $(GPU_RECORDS)/{date}-gpu-test-thorough-{part}.json
THOROUGH_LOGS ?= build/gpu-test-thorough
THOROUGH = $(BIN)/python tests/gpu/thorough_gpu.py --jobs $(THOROUGH_JOBS) --budget $(THOROUGH_BUDGET) \
	--out '$(THOROUGH_LOGS)/{part}' --record '$(THOROUGH_RECORD)'

.PHONY: demo test test-slow gpu-test gpu-test-thorough coverage lint docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,plots,qlora]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/kernelgraft demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# what `make test` leaves out: tests that run other Python processes (torchrun, notebooks, the
# README's examples) or judge a model over many batches; CI runs them after `make test`
test-slow: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m slow

gpu-test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m gpu -n $(GPU_WORKERS) --dist worksteal --record-json '$(GPU_RECORD)' $(PART:%=--part %)

# PART=K/N runs that part, PART=K the K-th of THOROUGH_PARTS; without PART, every part in turn
gpu-test-thorough: $(VENV)/.installed
ifdef PART
	$(THOROUGH) --part $(if $(findstring /,$(PART)),$(PART),$(PART)/$(THOROUGH_PARTS))
else
	status=0; for k in $$(seq 1 $(THOROUGH_PARTS)); do \
		$(THOROUGH) --part $$k/$(THOROUGH_PARTS) || status=1; done; exit $$status
endif

# every causal-LM architecture of the installed transformers, tiny and explained: the README's table
coverage: $(VENV)/.installed
	$(BIN)/python tests/models/coverage_all.py --write

lint: $(VENV)/.installed
	$(BIN)/python -m pip install -q ruff && $(BIN)/ruff check kernelgraft tests

# the documentation site (mkdocs.yml): docs/ and the docstrings, built into site/; a broken link fails it
docs: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build *.egg-info
