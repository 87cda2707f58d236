"""Test configuration.

Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors; that mode
is chosen when a kernel is defined, so TRITON_INTERPRET must be set before any
rlvr_kernels.triton import. On a GPU machine (scripts/gpu_check.sh) the same tests run
the compiled kernels on CUDA tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A private torch.compile cache per run: Inductor's on-disk cache does not key on a custom
# op's fake kernel, so a cache left by an older build of this package could replay graphs
# with stale output shapes.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="rlvr-kernels-inductor-")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
