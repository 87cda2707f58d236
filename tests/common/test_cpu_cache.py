"""The huge-page output cache of the C++ kernels (csrc/alloc.cpp)."""

import os
import subprocess
import sys

import pytest
import torch

import rlvr_kernels as rk


@pytest.mark.cpu_kernel
def test_large_outputs_are_reused_and_released():
    rk.empty_cpu_cache()
    mask = torch.ones(512, 1024)  # 2 MiB of token advantages: served by the cache
    scores = torch.randn(512)
    before = rk.cpu_cache_stats()
    out = rk.group_advantages(scores, group_size=8, response_mask=mask, backend="cpu")
    assert rk.cpu_cache_stats()["in_use_bytes"] >= mask.numel() * 4
    first_ptr = out.token_advantages.data_ptr()
    del out
    stats = rk.cpu_cache_stats()
    assert stats["cached_bytes"] >= mask.numel() * 4
    again = rk.group_advantages(scores, group_size=8, response_mask=mask, backend="cpu")
    assert again.token_advantages.data_ptr() == first_ptr
    assert rk.cpu_cache_stats()["reuses"] == before["reuses"] + 1
    # The reused buffer holds this call's values, not stale ones.
    torch.testing.assert_close(again.token_advantages, again.advantages[:, None] * mask)
    del again
    rk.empty_cpu_cache()
    assert rk.cpu_cache_stats()["cached_bytes"] == 0


@pytest.mark.cpu_kernel
def test_cache_limit_zero_disables_reuse():
    code = (
        "import torch, rlvr_kernels as rk\n"
        "m = torch.ones(512, 1024)\n"
        "for _ in range(3): rk.group_advantages(torch.randn(512), group_size=8, response_mask=m)\n"
        "s = rk.cpu_cache_stats(); assert s['limit_bytes'] == 0 and s['cached_bytes'] == 0 and s['reuses'] == 0, s\n"
    )
    env = dict(os.environ, RLVR_KERNELS_CPU_CACHE_MB="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
