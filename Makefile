# The two commands of the README: `make demo` and `make test`. Each builds .venv/ first if needed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The torch release kernelgraft is tested with on CPU machines; override for another build, e.g.
#   make test TORCH_SPEC='torch>=2.6'
TORCH_SPEC ?= torch==2.13.0
# test processes (pytest-xdist): the default suite takes about 14-15 min in two on a 2-core machine
TEST_WORKERS ?= 2

.PHONY: demo test test-slow gpu-test coverage lint docs clean

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
	$(BIN)/python -m pytest -q -m gpu $(if $(PART),--part $(PART))

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
