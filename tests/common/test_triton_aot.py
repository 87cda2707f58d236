"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed) without
register spills, and the GEMM kernels use the tensor cores (HGMMA / HMMA / DMMA in the
SASS of Triton's cubin). Runs in a subprocess: interpreted kernels (TRITON_INTERPRET=1,
set by conftest on CPU machines) cannot be compiled."""

import json
import os
import subprocess
import sys


def test_all_kernels_compile_for_sm80_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-m", "rlvr_kernels.triton.aot"], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    kernels = {r["kernel"] for r in rows}
    assert {
        "_group_stats_kernel[baseline=1]",
        "_sample_kernel[baseline=1,scale=1]",
        "_padded_tokens_kernel[mask=*fp32]",
        "_packed_tokens_kernel",
        "_moments_kernel",
        "_whiten_kernel",
    } <= kernels
    assert {
        "_block_offsets_kernel",
        "_seq_stats_kernel[a3po_prob,token_adv]",
        "_token_kernel[ppo,k3,token_tis]",
        "_token_kernel[ppo,k3,token_tis,packed]",
        "_token_kernel[fp64,everything]",
        "_finalize_kernel[padded]",
    } <= kernels
    lp_fwd = "_linear_fwd_kernel[bf16,bias=1,entropy=1]"
    assert {
        lp_fwd,
        "_linear_bwd_hidden_kernel[bf16,bias=1,grad_entropy=1]",
        "_linear_bwd_weight_kernel[bf16,bias=1,grad_entropy=1,need_w=1,need_b=1]",
        "_linear_fwd_kernel[fp64,bias=1,entropy=1]",
        "_logits_fwd_kernel[bf16,entropy=1]",
        "_logits_bwd_kernel[bf16,grad_entropy=1]",
    } <= kernels
    # logits_precision: fp32 inputs on bf16 / TF32 tensor cores, bf16 inputs with bf16 logits.
    precision_kernels = (
        {f"_linear_fwd_kernel[fp32,bias=1,entropy=1,{p}]" for p in ("bf16", "tf32")}
        | {f"_linear_bwd_weight_kernel[fp32,bias=1,grad_entropy=1,need_w=1,need_b=1,{p}]" for p in ("bf16", "tf32")}
        | {"_linear_fwd_kernel[bf16,bias=1,entropy=1,bf16]"}
    )
    assert precision_kernels <= kernels
    assert {"_sequence_kernel[bf16,padded]", "_sequence_kernel[fp32,packed]", "_batch_kernel"} <= kernels
    assert {r["arch"] for r in rows} == {"sm_80", "sm_90"}
    for r in rows:
        assert r["registers"] > 0, r
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
    # The bf16 logprobs GEMMs run on the tensor cores: wgmma (HGMMA) on sm_90, mma.sync
    # (HMMA) on sm_80; fp64 on the fp64 tensor cores (DMMA).
    mma = {(r["kernel"], r["arch"]): set(r["mma"]) for r in rows}
    for name, arch in mma:
        if name.startswith("_linear_") and "[bf16" in name:
            assert ("HGMMA" if arch == "sm_90" else "HMMA") in mma[name, arch], (name, arch)
        if name.startswith("_linear_") and name.endswith((",bf16]", ",tf32]")):
            assert ("HGMMA" if arch == "sm_90" else "HMMA") in mma[name, arch], (name, arch)
        if name.startswith("_linear_") and "[fp64" in name:
            assert "DMMA" in mma[name, arch], (name, arch)
    assert "HGMMA" in mma[lp_fwd, "sm_90"]
