"""Ahead-of-time compiles of every Triton kernel for sm_80 and sm_90, no GPU needed.

``python -m rlvr_kernels.triton.aot`` prints one JSON line per (kernel, variant, arch)
with the registers and spill bytes ``ptxas -v`` reports for the generated PTX (the
compiled kernel's own metadata only fills these in on a real device) and the matrix
instructions (HGMMA / HMMA / DMMA) in the SASS of Triton's cubin (``cuobjdump``). Run it
without ``TRITON_INTERPRET``: interpreted kernels cannot be compiled.

A spec is (name, kernel, signature, constexprs[, options]). A signature type may carry a
``:16`` divisibility hint (``"*bf16:16"``, ``"i32:16"``), as Triton's own launcher adds for
16-byte-aligned pointers and multiples of 16 at run time; GEMM kernels need it on the
pointers and the row length to get vectorised (and spill-free) tile loads. ``options``:
``num_warps`` / ``num_stages`` of the launch, and ``archs``: compile this spec for these
archs only (a kernel whose launch configuration depends on the arch has one spec per arch).
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


def kernel_specs() -> Iterator[Tuple]:
    """(name, kernel, signature, constexprs[, options]) for each kernel variant worth compiling."""
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
    yield from _logprobs_specs()


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


def _logprobs_specs():
    """The logprobs kernels at each arch's launch configuration (triton/logprobs.py
    ``config``: sm_90 has its own 16-bit forward tile): bf16 (tensor cores: HGMMA on sm_90,
    HMMA on sm_80), fp32 (IEEE FMA dot) and fp64 (DMMA), with / without bias, entropy and
    its gradient. H and the row strides carry the ``:16`` hint, as for real model sizes
    (another H runs unvectorised tile loads: correct, slower, not checked here)."""
    import torch
    import triton.language as tl

    from . import logprobs as k

    pi64 = "*i64:16"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

    def setup(kind, dt, arch):
        cfg = k.config(kind, dtypes[dt], arch)
        opts = {n: cfg.pop(n) for n in ("num_warps", "num_stages", "enable_fp_fusion") if n in cfg}
        opts["archs"] = (arch,)
        _, cdt = k.compute_dtype(dtypes[dt])
        c = "*fp64:16" if cdt is tl.float64 else "*fp32:16"
        const = dict(CDT=cdt, **cfg)
        if kind.startswith("linear"):
            const["OP"] = k.operand_dtype(dtypes[dt], interpret=False)
        return f"*{dt}:16", c, const, opts

    def linear_fwd(dt, bias, entropy, arch):
        inp, c, const, opts = setup("linear_fwd", dt, arch)
        sig = dict(x_ptr=inp, w_ptr=inp, b_ptr=inp, invt_ptr=c, rowptr_ptr=pi64, tgt_ptr=pi64, stats_ptr=c,
                   tlog_ptr=c, N="i32", V="i32", H="i32:16", M="i32")  # fmt: skip
        const.update(HAS_BIAS=bias, NEED_ENTROPY=entropy)
        name = f"_linear_fwd_kernel[{dt},bias={int(bias)},entropy={int(entropy)}]"
        return name, k._linear_fwd_kernel, sig, const, opts

    def linear_bwd(which, dt, bias, gent, arch, need_w=True, need_b=True):
        inp, c, const, opts = setup("linear_bwd", dt, arch)
        sig = dict(x_ptr=inp, w_ptr=inp, b_ptr=inp, invt_ptr=c, rowptr_ptr=pi64, tgt_ptr=pi64, g_ptr=c, lse_ptr=c,
                   ent_ptr=c, gent_ptr=c)  # fmt: skip
        const.update(HAS_BIAS=bias, HAS_GENT=gent)
        if which == "hidden":
            sig["gh_ptr"] = c
            kernel, extra = k._linear_bwd_hidden_kernel, ""
        else:
            sig.update(gw_ptr=c, gb_ptr=inp)
            const.update(NEED_W=need_w, NEED_B=need_b and bias)
            kernel, extra = k._linear_bwd_weight_kernel, f",need_w={int(need_w)},need_b={int(need_b and bias)}"
        sig.update(N="i32", V="i32", H="i32:16", M="i32")
        name = f"{kernel.__name__}[{dt},bias={int(bias)},grad_entropy={int(gent)}{extra}]"
        return name, kernel, sig, const, opts

    for arch in ARCHS:
        yield linear_fwd("bf16", True, True, arch)
        yield linear_fwd("bf16", False, False, arch)
        yield linear_fwd("fp32", True, True, arch)
        yield linear_fwd("fp64", True, True, arch)
        yield linear_bwd("hidden", "bf16", True, True, arch)
        yield linear_bwd("hidden", "fp32", True, True, arch)
        yield linear_bwd("hidden", "fp64", True, True, arch)
        yield linear_bwd("weight", "bf16", True, True, arch)
        yield linear_bwd("weight", "bf16", False, False, arch)
        yield linear_bwd("weight", "fp32", True, True, arch)
        yield linear_bwd("weight", "fp64", True, True, arch)

        for dt, flag in (("bf16", True), ("fp32", False), ("fp64", True)):
            inp, c, const, opts = setup("logits_fwd", dt, arch)
            sig = dict(l_ptr=inp, tgt_ptr=pi64, invt_ptr=c, stats_ptr=c, tlog_ptr=c, V="i32", stride="i32:16")
            const["NEED_ENTROPY"] = flag
            yield f"_logits_fwd_kernel[{dt},entropy={int(flag)}]", k._logits_fwd_kernel, sig, const, opts
            inp, c, const, opts = setup("logits_bwd", dt, arch)
            sig = dict(l_ptr=inp, tgt_ptr=pi64, invt_ptr=c, g_ptr=c, lse_ptr=c, ent_ptr=c, gent_ptr=c, out_ptr=inp,
                       V="i32:16", stride="i32:16")  # fmt: skip
            const["HAS_GENT"] = flag
            yield f"_logits_bwd_kernel[{dt},grad_entropy={int(flag)}]", k._logits_bwd_kernel, sig, const, opts


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


def sass_mma(cubin: bytes) -> List[str]:
    """The matrix-multiply opcodes (HGMMA, HMMA, DMMA, ...) in a cubin's SASS, sorted."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {res.stderr[-2000:]}")
    return sorted(set(re.findall(r"\b(HGMMA|HMMA|DMMA|IMMA|IGMMA|QGMMA|BMMA)\b", res.stdout)))


def compile_all(archs=ARCHS, only: str = "", shard: Tuple[int, int] = (0, 1)) -> List[Dict]:
    """Compile every spec (whose name contains ``only``) for each arch; ``shard=(k, n)``
    takes every n-th spec from the k-th (for parallel compiles in separate processes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for i, (name, kernel, sig, const, *rest) in enumerate(kernel_specs()):
        if only not in name or i % shard[1] != shard[0]:
            continue
        options = dict(rest[0]) if rest else {}
        spec_archs = options.pop("archs", archs)
        full_sig = {n: t.split(":")[0] for n, t in sig.items()}
        full_sig.update({c: "constexpr" for c in const})
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.endswith(":16")}
        for arch in (a for a in archs if a in spec_archs):
            compiled = triton.compile(ASTSource(fn=kernel, signature=full_sig, constexprs=const, attrs=attrs),
                                      target=GPUTarget("cuda", arch, 32), options=options)  # fmt: skip
            usage = ptxas_usage(compiled.asm["ptx"], arch)
            rows.append({"kernel": name, "arch": f"sm_{arch}", **usage, "mma": sass_mma(compiled.asm["cubin"])})
    return rows


def _main(argv: List[str]) -> None:
    """``[filter] [--shard k/n]``. Without ``--shard``, the specs are split over one
    process per CPU core (compiling is single-threaded and takes seconds per variant)."""
    shard = None
    if "--shard" in argv:
        i = argv.index("--shard")
        k, n = argv[i + 1].split("/")
        shard = (int(k), int(n))
        argv = argv[:i] + argv[i + 2 :]
    only = argv[0] if argv else ""
    if shard is not None:
        for row in compile_all(only=only, shard=shard):
            print(json.dumps(row), flush=True)
        return
    jobs = max(1, min(len(os.sched_getaffinity(0)), 8))
    procs = [subprocess.Popen([sys.executable, "-m", "rlvr_kernels.triton.aot", only, "--shard", f"{k}/{jobs}"],
                              stdout=subprocess.PIPE, text=True) for k in range(jobs)]  # fmt: skip
    failed = 0
    for p in procs:
        out, _ = p.communicate()
        sys.stdout.write(out)
        failed |= p.returncode != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled ahead of time")
    _main(sys.argv[1:])
