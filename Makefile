# The README's two commands: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOGDIR ?= logs
PORT ?= 6006
# SERVE=0 skips serving TensorBoard at the end of `make demo`.
SERVE ?= 1

.PHONY: demo test lint install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,tf-keras]'
	touch $@

install: $(VENV)/.installed

# oneDNN's float16 kernels are emulated on most CPUs (~50x slower steps):
# the demo trains on CPU with the plain kernels unless you set it yourself.
demo: export TF_ENABLE_ONEDNN_OPTS ?= 0
demo: install
	rm -rf $(LOGDIR)/mnist_mixed_float16 $(LOGDIR)/overflow_storm
	$(PY) examples/mnist_mixed_float16.py --log-dir $(LOGDIR)/mnist_mixed_float16
	$(PY) examples/overflow_storm.py --log-dir $(LOGDIR)/overflow_storm
	$(VENV)/bin/mpprof diagnose $(LOGDIR)
	$(VENV)/bin/mpprof report $(LOGDIR) -o $(LOGDIR)/report.html
	@if [ "$(SERVE)" = "1" ]; then \
	  echo "Serving TensorBoard at http://127.0.0.1:$(PORT)/#mpprof (Ctrl+C to stop; SERVE=0 skips)"; \
	  $(VENV)/bin/tensorboard --logdir $(LOGDIR) --host 127.0.0.1 --port $(PORT); \
	fi

test: install
	$(VENV)/bin/lint-imports
	MPPROF_REQUIRE_TF_KERAS=1 $(PY) -m pytest -q
	KERAS_BACKEND=jax $(PY) -m pytest -q tests/jax

lint: install
	$(VENV)/bin/ruff check mpprof tensorboard_plugin tests examples benchmarks

clean:
	rm -rf $(VENV) $(LOGDIR) .pytest_cache
