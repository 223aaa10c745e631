# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOGDIR ?= logs
PORT ?= 6006
# SERVE=0 skips serving TensorBoard at the end of `make demo`.
SERVE ?= 1

# The lowest versions pyproject.toml allows for the JAX extra
# (tests/lowest/constraints-jax.txt) and for the tensorflow and tf-keras
# extras (tests/lowest/constraints-tensorflow.txt), each in its own
# environment, on the lowest Python it allows where there is one: a fit with
# the callback, the CLI and the tab (tests/lowest/check.py) on each backend.
# The first run installs (about a minute for JAX, two for TensorFlow).
LOWEST ?= .venv-lowest
LOWEST_TF ?= .venv-lowest-tf
LOWEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10) \
                   $(shell command -v python3.10 2>/dev/null) $(PYTHON))

.PHONY: demo docs test test-lowest lint install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,tf-keras]'
	# The torch suite (tests/torch): pinned, so that pip takes the CPU build
	# where one is at hand rather than the newest (CUDA) release.
	$(PY) -m pip install --quiet 'torch==2.13.0'
	touch $@

install: $(VENV)/.installed

$(LOWEST)/.installed: pyproject.toml tests/lowest/constraints-jax.txt
	rm -rf $(LOWEST)
	$(LOWEST_PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST)/bin/python -m pip install --quiet -c tests/lowest/constraints-jax.txt '.[jax]'
	touch $@

$(LOWEST_TF)/.installed: pyproject.toml tests/lowest/constraints-tensorflow.txt
	rm -rf $(LOWEST_TF)
	$(LOWEST_PYTHON) -m venv $(LOWEST_TF)
	$(LOWEST_TF)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST_TF)/bin/python -m pip install --quiet -c tests/lowest/constraints-tensorflow.txt \
	  '.[tensorflow,tf-keras]'
	touch $@

# mpprof itself is installed again each time (as a wheel, not editable):
# the check runs the tree's code as a user's install would.
test-lowest: $(LOWEST)/.installed $(LOWEST_TF)/.installed
	$(LOWEST)/bin/python -m pip install --quiet --no-deps --force-reinstall .
	rm -rf $(LOWEST)/work && mkdir -p $(LOWEST)/work
	cd $(LOWEST)/work && JAX_PLATFORMS=cpu $(CURDIR)/$(LOWEST)/bin/python \
	  $(CURDIR)/tests/lowest/check.py .
	$(LOWEST_TF)/bin/python -m pip install --quiet --no-deps --force-reinstall .
	for backend in tensorflow tf_keras; do \
	  rm -rf $(LOWEST_TF)/work-$$backend && mkdir -p $(LOWEST_TF)/work-$$backend && \
	  (cd $(LOWEST_TF)/work-$$backend && $(CURDIR)/$(LOWEST_TF)/bin/python \
	    $(CURDIR)/tests/lowest/check.py . $$backend) || exit 1; \
	done

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

# mypy checks the backend protocol (pyproject's [tool.mypy]) before pytest.
test: install docs
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	MPPROF_REQUIRE_TF_KERAS=1 $(PY) -m pytest -q
	KERAS_BACKEND=jax $(PY) -m pytest -q tests/jax tests/test_backend_contract.py
	KERAS_BACKEND=torch $(PY) -m pytest -q tests/torch tests/test_backend_contract.py
	$(MAKE) test-lowest

lint: install
	$(VENV)/bin/ruff check mpprof tensorboard_plugin tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(LOWEST) $(LOWEST_TF) $(LOGDIR) .pytest_cache site
