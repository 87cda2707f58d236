"""Ahead-of-time compiles of every Triton kernel for sm_80 and sm_90, no GPU needed.

``python -m rlvr_kernels.triton.aot`` prints one JSON line per (kernel, variant, arch)
with the registers and spill bytes ``ptxas -v`` reports for the generated PTX (the
compiled kernel's own metadata only fills these in on a real device). Run it without
``TRITON_INTERPRET``: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List, Tuple

ARCHS = (80, 90)


def kernel_specs() -> Iterator[Tuple[str, object, Dict[str, str], Dict[str, object]]]:
    """(name, kernel, signature, constexprs) for each kernel variant worth compiling."""
    from . import advantages as k

    p32, pi64, pi8 = "*fp32", "*i64", "*i8"
    for baseline in (k.MEAN, k.OPO, k.PASSK):
        sig = dict(scores_ptr="*bf16", order_ptr=pi64, offsets_ptr=pi64, weight_ptr=p32, mean_ptr=p32, std_ptr=p32,
                   ext_a_ptr=p32, ext_b_ptr=p32, count_ptr=pi64, degenerate_ptr=pi8, passk_k="i32", eps="fp32")  # fmt: skip
        const = dict(STD_UNBIASED=True, EPS_IN_SQRT=False, BASELINE=baseline, HAS_WEIGHT=baseline == k.OPO, BLOCK=64)
        yield f"_group_stats_kernel[baseline={baseline}]", k._group_stats_kernel, sig, const
    yield ("_moments_kernel", k._moments_kernel, dict(values_ptr=p32, weight_ptr=p32, out_ptr=p32, B="i32"),
           dict(BLOCK=1024))  # fmt: skip
    for baseline, scale in ((k.MEAN, k.SCALE_GROUP), (k.MEAN, k.SCALE_BATCH), (k.GPG, k.SCALE_NONE), (k.PASSK, 0)):
        sig = dict(scores_ptr=p32, group_ptr=pi64, ok_ptr=pi8, mean_ptr=p32, std_ptr=p32, ext_a_ptr=p32, ext_b_ptr=p32,
                   count_ptr=pi64, degenerate_ptr=pi8, moments_ptr=p32, adv_ptr=p32, keep_ptr=pi8, B="i32", G="i32",
                   eps="fp32")  # fmt: skip
        const = dict(BASELINE=baseline, SCALE=scale, STD_UNBIASED=True, EPS_IN_SQRT=False, SINGLETON_RAW=True, BLOCK=1024)
        yield f"_sample_kernel[baseline={baseline},scale={scale}]", k._sample_kernel, sig, const
    yield ("_whiten_kernel", k._whiten_kernel, dict(adv_ptr=p32, weight_ptr=p32, moments_ptr=p32, B="i32", eps="fp32"),
           dict(EPS_IN_SQRT=True, BLOCK=1024))  # fmt: skip
    for packed in (False, True):
        sig = dict(mask_ptr=p32, cu_ptr=pi64, out_ptr=p32, B="i32", L="i32", T="i64")
        yield f"_row_sum_kernel[packed={packed}]", k._row_sum_kernel, sig, dict(PACKED=packed, BLOCK=1024)
    for mask in ("*fp32", "*i1"):
        sig = dict(adv_ptr=p32, mask_ptr=mask, out_ptr=p32, B="i32", L="i32")
        yield f"_padded_tokens_kernel[mask={mask}]", k._padded_tokens_kernel, sig, dict(BLOCK_B=2, BLOCK_L=1024)
    sig = dict(adv_ptr=p32, cu_ptr="*i32", mask_ptr="*i1", out_ptr="*bf16", B="i32", T="i64")
    yield "_packed_tokens_kernel", k._packed_tokens_kernel, sig, dict(HAS_MASK=True, SEARCH_STEPS=14, BLOCK=1024)


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself uses for this arch (Triton 3.9 ships two; older ones one)."""
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(arch).path
    except TypeError:  # Triton < 3.9: get_ptxas() takes no arch
        return compiler.get_ptxas().path


def ptxas_usage(ptx: str, arch: int) -> Dict[str, int]:
    """Registers and spill bytes from ``ptxas -v`` on the PTX Triton generated."""
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [_ptxas(arch), "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}", src, "-o", out]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed: {res.stderr[-2000:]}")
    text = res.stderr + res.stdout
    regs = re.findall(r"Used (\d+) registers", text)
    stores = re.findall(r"(\d+) bytes spill stores", text)
    loads = re.findall(r"(\d+) bytes spill loads", text)
    return {
        "registers": max(map(int, regs)) if regs else -1,
        "spill_store_bytes": sum(map(int, stores)),
        "spill_load_bytes": sum(map(int, loads)),
    }


def compile_all(archs=ARCHS) -> List[Dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for name, kernel, sig, const in kernel_specs():
        full_sig = dict(sig)
        full_sig.update({c: "constexpr" for c in const})
        for arch in archs:
            compiled = triton.compile(ASTSource(fn=kernel, signature=full_sig, constexprs=const),
                                      target=GPUTarget("cuda", arch, 32))  # fmt: skip
            usage = ptxas_usage(compiled.asm["ptx"], arch)
            rows.append({"kernel": name, "arch": f"sm_{arch}", **usage})
    return rows


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled ahead of time")
    for row in compile_all():
        print(json.dumps(row))
