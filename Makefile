# energyformer: two commands do all set-up (see README.md).
#   make run   -> .venv, install, prepare Shakespeare, train the default NRGPT on CPU, print val loss + a sample
#   make test  -> .venv, install with test extras, run the default (fast) test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
RECIPE ?= configs/shakespeare_char/nrgpt.yaml
RUN_DIR ?= out/nrgpt
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test test-slow bench venv install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first, pinned to the CPU wheel these machines carry, unless an importable torch is already there.
$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	@touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e ".[dev,hf]"
	@touch $@

venv: $(PY)
install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/energyformer prepare shakespeare_char
	$(VENV)/bin/energyformer train $(RECIPE) --train.out_dir $(RUN_DIR)
	$(VENV)/bin/energyformer sample $(RUN_DIR) --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 --top-k 40 --seed 0

# the default suite in TEST_WORKERS processes (pytest-xdist): about 7.5 min on 2 idle cores (452 s on 2026-12-02)
TEST_WORKERS ?= 2
test: install-test
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS)

test-slow: install-test
	$(VENV)/bin/python -m pytest -m slow

bench: install-test
	PY=$(VENV)/bin/python bash benchmarks/run_all.sh

clean:
	rm -rf $(VENV) out .pytest_cache
