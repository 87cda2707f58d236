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
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# Property tests. Locally ("default") hypothesis explores: a fresh seed each run, failures
# kept in .hypothesis/ and replayed first. Under CI (CI=true) they are derandomised: the
# examples follow from the test's source alone, so one commit gives one result. "explore"
# (make explore) runs many more examples on a fresh seed; each failure it finds becomes an
# @example regression test. "explicit" runs only the @example cases.
_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("default", max_examples=25, **_COMMON)
settings.register_profile("ci", max_examples=25, derandomize=True, database=None, **_COMMON)
settings.register_profile("explore", max_examples=int(os.environ.get("EXPLORE_EXAMPLES", "400")), **_COMMON)
settings.register_profile("explicit", phases=[Phase.explicit], **_COMMON)
_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if _CI else "default"))


def pytest_collection_modifyitems(items):
    """Mark every hypothesis test ``property`` (``make explore`` selects them)."""
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
