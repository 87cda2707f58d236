# The README's two commands. Each bootstraps .venv on a machine with only Python and a
# C++ compiler: torch (kept if the environment already has one), the package (pure Python,
# editable) with the test/bench extras and the peer libraries, then `rlvr-kernels build`,
# which compiles the C++ kernels against that torch into the cache ($RLVR_KERNELS_CACHE,
# default ~/.cache/rlvr_kernels) so the first test does not pay the compile.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# On these machines torch==2.13.0 is the CPU wheel on local disk; elsewhere pip fetches it.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.rlvr-kernels-installed
# Peers whose declared dependencies would replace torch (or need CUDA): installed without
# them, plus what the modules the tests import need. flash-attn (imported by openrlhf.models)
# has no CPU build; rlvr_kernels.testing.peers stands in for it. megatron-core is what slime's
# hooks run under (slime itself is not a package on the registry).
PEERS_NO_DEPS := openrlhf==0.11.2 deepspeed==0.19.6 areal==1.0.4 skyrl==0.3.0 megatron-core==0.16.1
PEER_IMPORTS := hjson msgpack py-cpuinfo colorlog tenacity lark uvloop numba aiofiles openai jaxtyping loguru
SOURCES := pyproject.toml $(wildcard rlvr_kernels/csrc/*.cpp rlvr_kernels/csrc/*.h)

.PHONY: install test explore bench check sanitize format clean

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): $(PY) $(SOURCES)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,bench,peers]"
	DS_BUILD_OPS=0 $(PIP) install -q --no-deps --no-build-isolation $(PEERS_NO_DEPS)
	$(PIP) install -q $(PEER_IMPORTS)
	$(VENV)/bin/rlvr-kernels build
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

# The sanitizer build has its own cache key; `rlvr-kernels build` prints its path, and
# RLVR_KERNELS_EXTENSION makes the tests load it instead of the release build.
sanitize: $(STAMP)
	lib="$$($(VENV)/bin/rlvr-kernels build --sanitize)" && \
	LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	RLVR_KERNELS_EXTENSION="$$lib" \
	$(PY) -m pytest -q -m cpu_kernel -p no:cacheprovider --capture=sys

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The compiled kernels live in the cache (see above), not in the tree: `rlvr-kernels info`
# names the directory.
clean:
	rm -rf build dist *.egg-info
