#!/usr/bin/env bash
# Downloads (here, where PyPI is reachable) the wheels scripts/gpu_check.sh installs on the
# lent GPU machine, which has no registry but has torch, triton, transformers, accelerate.
# They go to .whl/ (git-ignored); pass carry=[".whl"] to the device run.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" -d .whl "$@"; }
# Peers (pure Python) and what their modules import that the GPU image lacks.
dl verl==0.9.1 trl==1.16.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1
dl tensordict==0.10.0 omegaconf==2.3.1 codetiming==1.4.0 orjson pyvers==0.1.0 importlib_metadata
dl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# ninja, with which rlvr_kernels compiles its C++ kernels.
dl ninja
# antlr4 4.9.3 (omegaconf's parser) ships only as a source archive: build its wheel here.
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
du -sh .whl && ls .whl
