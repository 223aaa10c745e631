# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOGDIR ?= logs
PORT ?= 6006
# SERVE=0 skips serving TensorBoard at the end of `make demo`.
SERVE ?= 1

.PHONY: demo docs test lint install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,tf-keras]'
	# The torch suite (tests/torch): pinned, so that pip takes the CPU build
	# where one is at hand rather than the newest (CUDA) release.
	$(PY) -m pip install --quiet 'torch==2.13.0'
	touch $@

install: $(VENV)/.installed

# oneDNN's float16 kernels are emulated on most CPUs (~50x slower steps):
# the demo trains on CPU with the plain kernels unless you set it yourself.
demo: export TF_ENABLE_ONEDNN_OPTS ?= 0
demo: install
	@$(PY) examples/demo.py --log-dir $(LOGDIR) --port $(PORT)
	@if [ "$(SERVE)" = "1" ]; then \
	  echo "Serving TensorBoard at http://127.0.0.1:$(PORT)/#mpprof (Ctrl+C to stop; SERVE=0 skips)"; \
	  $(VENV)/bin/tensorboard --logdir $(LOGDIR) --host 127.0.0.1 --port $(PORT); \
	fi

# The documentation site (mkdocs.yml): --strict fails on a broken link or a
# page left out of the nav. `make test` builds it, so CI does.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: install docs
	$(VENV)/bin/lint-imports
	MPPROF_REQUIRE_TF_KERAS=1 $(PY) -m pytest -q
	KERAS_BACKEND=jax $(PY) -m pytest -q tests/jax
	KERAS_BACKEND=torch $(PY) -m pytest -q tests/torch

lint: install
	$(VENV)/bin/ruff check mpprof tensorboard_plugin tests examples benchmarks

clean:
	rm -rf $(VENV) $(LOGDIR) .pytest_cache site
