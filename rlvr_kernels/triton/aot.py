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
    yield from _policy_loss_specs()


def _policy_loss_specs():
    """The policy_loss kernels: the common single pass, each loss type and feature family,
    the fp64 variants, and the per-sequence (GSPO / seq IS / A3PO) pre-pass."""
    import triton.language as tl

    from . import policy_loss as k

    pi64 = "*i64"
    yield ("_block_offsets_kernel", k._block_offsets_kernel, dict(cu_ptr=pi64, boff_ptr=pi64, B="i32", T="i32"),
           dict(TOKEN_BLOCK=k._TOKEN_BLOCK, BLOCK=1024))  # fmt: skip

    def seq_stats(name, inp, cdt, **const):
        c = "*fp64" if cdt is tl.float64 else "*fp32"
        sig = dict(logp_ptr=inp, old_ptr=inp, adv_ptr=c, mask_ptr="*i1", roll_ptr=inp, ent_ptr=inp, cu_ptr=pi64,
                   seqf_ptr=c, a3po_ptr=pi64, B="i32", L="i32", T="i32")  # fmt: skip
        sig.update({n: "fp64" for n in ("r_pos_high", "s_pos_high", "r_pos_low", "s_pos_low", "r_neg_high",
                                        "s_neg_high", "r_neg_low", "s_neg_low")})  # fmt: skip
        full = dict(CDT=cdt, PACKED=False, HAS_MASK=True, SEQ_ADV=True, NEED_DELTA=False, NEED_LOGW=False,
                    A3PO=False, A3PO_ENT=False)  # fmt: skip
        full.update(const)
        full["BLOCK"] = k.seq_block(cdt is tl.float64, full["A3PO"])
        return f"_seq_stats_kernel[{name}]", k._seq_stats_kernel, sig, full

    yield seq_stats("seq_mean,packed", "*bf16", tl.float32, PACKED=True)
    yield seq_stats("gspo,seq_tis", "*bf16", tl.float32, NEED_DELTA=True, NEED_LOGW=True)
    yield seq_stats("a3po_prob,token_adv", "*bf16", tl.float32, A3PO=True, SEQ_ADV=False)
    yield seq_stats("a3po_entropy,packed", "*fp32", tl.float32, A3PO=True, A3PO_ENT=True, PACKED=True)
    yield seq_stats("fp64,all", "*fp64", tl.float64, NEED_DELTA=True, NEED_LOGW=True, A3PO=True)

    floats = ("clip_lo", "clip_hi", "clip_c", "lr_clamp", "gspo_clamp", "tau_pos", "tau_neg", "kl_coef", "rc_low",
              "rc_high", "ent_coef", "w_pos", "w_neg", "prob_lambda", "s_pos_high", "s_pos_low", "s_neg_high",
              "s_neg_low")  # fmt: skip

    def token(name, inp, cdt, **const):
        c = "*fp64" if cdt is tl.float64 else "*fp32"
        sig = dict(logp_ptr=inp, old_ptr=inp, adv_ptr=c, mask_ptr="*i1", ref_ptr=inp, roll_ptr=inp, ent_ptr=inp,
                   thr_ptr="*fp32", cu_ptr=pi64, boff_ptr=pi64, seqf_ptr=c, a3po_ptr=pi64, grad_ptr=c, gent_ptr=c,
                   tok_ptr=c, part_ptr=c, B="i32", L="i32", T="i32", NBL="i32")  # fmt: skip
        sig.update({n: "fp64" for n in floats})
        full = dict(CDT=cdt, PACKED=False, HAS_MASK=True, SEQ_ADV=True, LOSS=k.PPO, DUAL_CLIP=False, LR_CLAMP=True,
                    KL=0, KL_CLAMP=True, RC=0, SEQ_MEAN=False, N_FROM_STATS=False, TOKEN_OUT=0, HAS_ENT=False,
                    ENT_TERM=False, ENT_GRAD=False, SHAPE_POL=False, SHAPE_PROB=False, A3PO=False, A3PO_ENT=False,
                    ENT_Q=False, SEARCH_STEPS=1)  # fmt: skip
        full.update(const)
        full["BLOCK"] = k.token_block(cdt is tl.float64, full["A3PO"] or full["SHAPE_PROB"])
        return f"_token_kernel[{name}]", k._token_kernel, sig, full

    common = dict(KL=k.K3, RC=k.TOKEN_TIS)
    yield token("ppo,k3,token_tis", "*bf16", tl.float32, **common)
    yield token("ppo,k3,token_tis,packed", "*bf16", tl.float32, PACKED=True, HAS_MASK=False, SEARCH_STEPS=8, **common)
    yield token("ppo,fp32,dual_clip,k1", "*fp32", tl.float32, DUAL_CLIP=True, KL=k.K1, SEQ_ADV=False)
    yield token("gspo,seq_tis,seq_mean", "*bf16", tl.float32, LOSS=k.GSPO, RC=k.SEQ_TIS, SEQ_MEAN=True,
                N_FROM_STATS=True)  # fmt: skip
    yield token("cispo,k2,token_mis", "*fp16", tl.float32, LOSS=k.CISPO, KL=k.K2, RC=k.TOKEN_MIS)
    yield token("sapo,seq_mis,entropy", "*bf16", tl.float32, LOSS=k.SAPO, RC=k.SEQ_MIS, HAS_ENT=True, ENT_TERM=True,
                ENT_GRAD=True)  # fmt: skip
    yield token("reinforce,shaping,token_out=2", "*fp32", tl.float32, LOSS=k.REINFORCE, SHAPE_POL=True,
                SHAPE_PROB=True, A3PO=True, HAS_ENT=True, ENT_Q=True, TOKEN_OUT=2, SEQ_ADV=False)  # fmt: skip
    everything = dict(DUAL_CLIP=True, KL=k.K3PLUS, RC=k.DECOUPLED, SEQ_MEAN=True, N_FROM_STATS=True, TOKEN_OUT=1,
                      HAS_ENT=True, ENT_TERM=True, ENT_GRAD=True, SHAPE_POL=True, SHAPE_PROB=True, A3PO=True,
                      A3PO_ENT=True, ENT_Q=True)  # fmt: skip
    yield token("everything,packed", "*bf16", tl.float32, PACKED=True, SEARCH_STEPS=8, **everything)
    yield token("fp64,everything", "*fp64", tl.float64, **everything)
    yield token("fp64,gspo", "*fp64", tl.float64, LOSS=k.GSPO, KL=k.K3)

    for name, cdt, packed, stats in (("padded", tl.float32, False, False), ("packed", tl.float32, True, False),
                                     ("stats,fp64", tl.float64, False, True)):  # fmt: skip
        c = "*fp64" if cdt is tl.float64 else "*fp32"
        sig = dict(part_ptr=c, seqf_ptr=c, boff_ptr=pi64, sums_ptr=c, P="i32", B="i32", NBL="i32")
        yield (f"_finalize_kernel[{name}]", k._finalize_kernel, sig,
               dict(CDT=cdt, PACKED=packed, HAS_STATS=stats, ROWS=64, SEQS=256))  # fmt: skip


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
