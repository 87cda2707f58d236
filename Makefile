# The README's two commands. Each bootstraps .venv on a machine with only Python and a
# C++ compiler: torch (kept if the environment already has one), the package with its
# C++ extension built against that torch, the test/bench extras and the peer libraries.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# On these machines torch==2.13.0 is the CPU wheel on local disk; elsewhere pip fetches it.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.rlvr-kernels-installed
SOURCES := pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: install test explore bench check sanitize format clean

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): $(PY) $(SOURCES)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q setuptools wheel ninja pybind11
	$(PIP) install -q --no-build-isolation -e ".[test,bench,peers]"
	touch $(STAMP)

install: $(STAMP)

# Lint and format check, the whole suite, then the C++ op tests again under
# AddressSanitizer + UBSan.
test: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory sanitize

# The property tests with many more examples (EXPLORE_EXAMPLES, default 400) on a fresh
# seed: run before every commit that touches an op, and turn each failure it prints into
# an @example regression test. Failures are also kept in .hypothesis/ and replayed first.
explore: $(STAMP)
	HYPOTHESIS_PROFILE=explore $(PY) -m pytest -q -m property -p no:cacheprovider $(EXPLORE_ARGS)

bench: $(STAMP)
	$(VENV)/bin/rlvr-kernels bench

check: $(STAMP)
	$(VENV)/bin/rlvr-kernels check

SAN_DIR := sanitize-build
sanitize: $(STAMP)
	rm -rf $(SAN_DIR)
	RLVR_KERNELS_SANITIZE=1 $(PY) setup.py -q build_ext --build-lib $(SAN_DIR) --build-temp $(SAN_DIR)/tmp
	LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	RLVR_KERNELS_EXTENSION="$$(ls $(SAN_DIR)/rlvr_kernels/_C*.so)" \
	$(PY) -m pytest -q -m cpu_kernel -p no:cacheprovider --capture=sys

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf build $(SAN_DIR) *.egg-info rlvr_kernels/*.so
