# `make demo` and `make test` work on a fresh machine: they create .venv/ and install
# everything (tensorflow-cpu 2.15.1, tensorflow-estimator 2.15.0, numpy<2, ortools,
# networkx, pytest, pytest-xdist; `make test` also builds Horovod 0.28.1) before running.
# The suite runs in PYTEST_WORKERS processes (pytest-xdist, a test file per process at a
# time: files share their expensive fixtures), then the multi-process tests (marked slow)
# one at a time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOROVOD_STAMP := $(VENV)/.horovod-stamp
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: demo test test-fast bench horovod chromium clean

$(STAMP): requirements.txt setup.py
	@echo "tfpar: creating $(VENV)/ and installing TensorFlow 2.15 and the other requirements (1-3 minutes with pip's cache, longer without; pip runs quietly)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/data_parallel_mlp.py --report plan_report.html

# The full suite includes the Horovod backend's tests: Horovod is built first.
test: $(STAMP) $(HOROVOD_STAMP) chromium
	$(PY) -m pytest tests $(PARALLEL) -m "not slow" $(PYTEST_ARGS)
	$(PY) -m pytest tests -m slow $(PYTEST_ARGS)

# Everything but the tests marked slow (multi-process ones) or horovod (no Horovod needed).
test-fast: $(STAMP) chromium
	$(PY) -m pytest tests $(PARALLEL) -m "not slow and not horovod" $(PYTEST_ARGS)

bench: $(STAMP) $(HOROVOD_STAMP)
	$(PY) benchmarks/overhead.py --check
	$(PY) benchmarks/split.py --check
	$(PY) benchmarks/multiworker.py --check
	$(PY) benchmarks/planner.py --check
	$(PY) benchmarks/plan_quality.py --check
	$(PY) benchmarks/startup.py --check
	$(PY) benchmarks/tf2.py --check
	$(PY) benchmarks/plan_scale.py --check
	$(PY) benchmarks/retune.py --check
	$(PY) benchmarks/batch_norm.py --check

# Horovod 0.28.1 built from source against the installed TF (~3 min, then pip's
# wheel cache; for communication.backend "horovod", not needed otherwise).
horovod: $(HOROVOD_STAMP)

$(HOROVOD_STAMP): $(STAMP)
	@echo "tfpar: building Horovod 0.28.1 against the installed TensorFlow (about 3 minutes the first time, seconds from pip's wheel cache)"
	HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
	HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
	$(PY) -m pip install -q --no-build-isolation horovod==0.28.1
	touch $(HOROVOD_STAMP)

# Headless Chromium for tests/test_report_browser.py: Debian's package, installed
# when absent where this runs as root with apt-get; elsewhere that test is skipped
# (pytest names the reason).
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
	  || echo "tfpar: chromium is not installed (needs root and apt-get): the browser test will be skipped"; }

clean:
	rm -rf $(VENV) *.egg-info
