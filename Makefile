# `make demo` and `make test` work on a fresh machine: they create .venv/ and install
# everything (tensorflow-cpu 2.15.1, tensorflow-estimator 2.15.0, numpy<2, ortools 9.9,
# networkx, pytest, pytest-xdist; `make test` also builds Horovod 0.28.1) before running.
# The suite runs in PYTEST_WORKERS processes (pytest-xdist, a test file per process at a
# time: files share their expensive fixtures), then the multi-process
# tests and the benchmarks' quickest modes (marked slow; mostly waiting on their processes)
# test by test on as many. The scripts a test runs start as forks of a process that
# imported TensorFlow once (tests/warm_python.py), not as fresh Pythons.
#
# TF=2.21 (`make test TF=2.21`, `make demo TF=2.21`, `make test-core TF=2.21`) uses the
# other tested TensorFlow instead: .venv-tf2.21/ with tensorflow-cpu 2.21, tf-keras 2.21
# and Keras 2 as tf.keras (TF_USE_LEGACY_KERAS=1), requirements-tf2.21.txt. Horovod is not
# built there (its tests are left out). `make test-core` runs the equivalence core (data
# parallel, pipeline, split, TF2, checkpoints, batch norm, real steps) in either one.
PYTHON ?= python3
TF ?= 2.15
ifeq ($(TF),2.15)
VENV := .venv
REQUIREMENTS := requirements.txt
ACTIVATE_LEGACY_KERAS := true
else ifeq ($(TF),2.21)
VENV := .venv-tf2.21
REQUIREMENTS := requirements-tf2.21.txt
export TF_USE_LEGACY_KERAS := 1
# ... and `source .venv-tf2.21/bin/activate` sets it too.
ACTIVATE_LEGACY_KERAS := echo 'export TF_USE_LEGACY_KERAS=1' >> $(VENV)/bin/activate
else
$(error TF=$(TF): tfpar's Makefile builds TF=2.15 (the default) or TF=2.21)
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOROVOD_STAMP := $(VENV)/.horovod-stamp
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile
# Horovod 0.28.1 builds against TensorFlow 2.15 only: on 2.21 the suite leaves its tests out.
ifeq ($(TF),2.15)
WITH_HOROVOD := $(HOROVOD_STAMP)
NOT_HOROVOD :=
else
WITH_HOROVOD :=
NOT_HOROVOD := and not horovod
endif
CORE := tests/test_versions.py tests/test_data_parallel.py tests/test_pipeline.py \
	tests/test_split.py tests/test_tf2.py tests/test_checkpoint.py tests/test_batch_norm.py \
	tests/test_real_steps.py tests/test_real_steps_tf2.py tests/test_keras3.py

.PHONY: demo test test-fast test-core bench horovod chromium clean

$(STAMP): $(REQUIREMENTS) setup.py
	@echo "tfpar: creating $(VENV)/ and installing TensorFlow $(TF) and the other requirements (1-3 minutes with pip's cache, longer without; pip runs quietly)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(REQUIREMENTS)
	$(PY) -m pip install -q --no-deps -e .
	$(ACTIVATE_LEGACY_KERAS)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/data_parallel_mlp.py --report plan_report.html

# The full suite includes the Horovod backend's tests: Horovod is built first.
test: $(STAMP) $(WITH_HOROVOD) chromium
	$(PY) -m pytest tests $(PARALLEL) -m "not slow $(NOT_HOROVOD)" $(PYTEST_ARGS)
	$(PY) -m pytest tests -n $(PYTEST_WORKERS) --dist load -m "slow $(NOT_HOROVOD)" $(PYTEST_ARGS)

# The equivalence core (one file at a time, the multi-process tests left out): what must
# hold on both TensorFlow versions (`make test-core TF=2.21`).
test-core: $(STAMP)
	for f in $(CORE); do $(PY) -m pytest $$f -m "not slow $(NOT_HOROVOD)" $(PYTEST_ARGS) || exit 1; done

# Everything but the tests marked slow (multi-process ones) or horovod (no Horovod needed).
test-fast: $(STAMP) chromium
	$(PY) -m pytest tests $(PARALLEL) -m "not slow and not horovod" $(PYTEST_ARGS)

bench: $(STAMP) $(WITH_HOROVOD)
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
	rm -rf .venv .venv-tf2.21 *.egg-info
