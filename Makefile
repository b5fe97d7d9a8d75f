# flexplan developer entry points. `make test` and `make demo` set up their own virtualenv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flexplan-installed

.PHONY: test demo gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0 (CPU) is the build this machine keeps on disk; Triton comes from the registry.
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Kernels run on the CPU through Triton's interpreter, two test processes at a time (the
# interpreter is single-threaded Python: the 2 cores of CI halve the suite's time).
# TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The main job end to end: real sizes on a GPU, a small size through the interpreter elsewhere.
demo: $(STAMP)
	$(PY) scripts/demo.py

# On the GPU machine (system python with torch + triton, no network): GPU tests and benchmarks.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# Precompile the kernel variants flexplan dispatches into aot_bundle/ (python -m aot --help;
# docs/aot.md): for this machine's GPUs, or without one for every target flexplan knows
# (sm_80 sm_86 sm_89 sm_90 gfx90a gfx942 gfx1100); ninja's progress, then binaries, MB and time.
# e.g. make aot AOT_ARGS="--targets sm_90 --install", or AOT_ARGS="--wheel" for pip-installable
# flexplan_kernels_<target> wheels in aot_bundle/dist/.
.PHONY: aot
aot: $(STAMP)
	$(PY) -m aot $(AOT_ARGS)

# On a GPU: measure the conv kernel configs and save this GPU's tuned table (user cache dir);
# e.g. make tune TUNE_ARGS="--shells 256:64 --dtypes float16".
.PHONY: tune
tune: $(STAMP)
	$(PY) -m flexplan tune $(TUNE_ARGS)
