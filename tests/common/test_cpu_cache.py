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
def test_mid_sized_outputs_are_reused():
    """Outputs from 64 KiB to 1 MiB (here the per-group statistics of 65 536 groups) come from
    the cache too, so a training loop's calls do not pay their page faults again."""
    rk.empty_cpu_cache()
    scores = torch.randn(1 << 17)
    out = rk.group_advantages(scores, group_size=2, backend="cpu")
    assert out.group_count.numel() * 8 == 512 << 10  # int64 [65536]: 512 KiB
    del out
    first = rk.cpu_cache_stats()
    assert first["cached_bytes"] >= 512 << 10
    again = rk.group_advantages(scores, group_size=2, backend="cpu")
    second = rk.cpu_cache_stats()
    # every block of the second call came from the cache: no new memory, 4+ reuses
    # (count, mean and std, staged and cast)
    assert second["cached_bytes"] + second["in_use_bytes"] == first["cached_bytes"] + first["in_use_bytes"]
    assert second["reuses"] >= first["reuses"] + 4
    ref = rk.group_advantages(scores, group_size=2, backend="reference")
    torch.testing.assert_close(again.group_mean, ref.group_mean)
    torch.testing.assert_close(again.group_count, ref.group_count)
    del again
    rk.empty_cpu_cache()


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
