# Two commands do all the set-up on a fresh machine (see README):
#   make repro   # create .venv, install rlpipe (CPU torch), run `dvc repro` on the embedded default
#   make test    # same install, then the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Installed first and on its own: a bare `torch` would pull a multi-GB CUDA build.
# On a GPU machine, install your CUDA torch first and use `make TORCH_SPEC= repro`.
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install repro iterations test
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(BIN)/python -m pip install -q "$(TORCH_SPEC)")
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# `dvc plots show` pages that carry the Vega libraries (from the vl-convert-python wheel): no CDN needed.
OFFLINE_PLOTS := .rlpipe/dvc-plots/offline-template.html
$(OFFLINE_PLOTS): $(VENV)/.installed
	$(BIN)/rlpipe plots setup

repro: install $(OFFLINE_PLOTS)
	PATH="$(abspath $(BIN)):$$PATH" dvc repro
	@echo "next: . $(VENV)/bin/activate, then 'rlpipe inspect . --show 4', 'dvc metrics show', 'rlpipe iterate' (commit + tag iteration 0)"

iterations: install
	PATH="$(abspath $(BIN)):$$PATH" rlpipe run --iterations $(or $(N),5)

test: install
	PATH="$(abspath $(BIN)):$$PATH" python -m pytest -q
