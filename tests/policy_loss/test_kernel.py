"""The raw ``policy_loss_fwd`` / ``policy_loss_grad`` kernels (the C++ op
``torch.ops.rlvr_kernels_C.policy_loss_fwd`` and the Triton launcher of the same name)
against their contract (rlvr_kernels/ops/policy_loss.py, rlvr_kernels/contracts/policy_loss.py):
the sums, per-token outputs and gradients of small valid cases against the fp64 reference,
and, for the registered C++ op that anyone can call, inconsistent shapes, unknown branch
codes, parameter lists of the wrong length and garbage cu_seqlens (an error, or results that
stay in bounds: the same as for the sanitised offsets). The C++ tests are marked cpu_kernel,
so ``make sanitize`` re-runs them under ASan/UBSan."""

import importlib
import os
import subprocess
import sys

import pytest
import torch
from _backends import DEVICE

import rlvr_kernels as rk
from rlvr_kernels import TokenShaping
from rlvr_kernels._core.dispatch import load_extension
from rlvr_kernels._core.layout import sanitized_offsets
from rlvr_kernels.contracts.policy_loss import (
    NUM_SUMS,
    KlEstimator,
    LossType,
    PolicyLossParams,
    PolicyLossSum,
    RolloutCorrectionCode,
    TokenOut,
)
from rlvr_kernels.testing import as_float64, random_policy_case
from rlvr_kernels.triton import policy_loss as triton_policy_loss

ops = importlib.import_module("rlvr_kernels.ops.policy_loss")
ref_pl = importlib.import_module("rlvr_kernels.reference.policy_loss")
S = PolicyLossSum

# No skip: a missing build is a failure (`make test` builds it).
assert load_extension(), "the C++ kernels are not built: see `rlvr-kernels info` and `rlvr-kernels build`"
K = torch.ops.rlvr_kernels_C

CPP = pytest.param("cpp", "cpu", id="cpp", marks=pytest.mark.cpu_kernel)
TRITON = pytest.param("triton", DEVICE, id=f"triton-{DEVICE}")


def kernel(which):
    return K.policy_loss_fwd if which == "cpp" else triton_policy_loss.policy_loss_fwd


# ------------------------------------------------------------------ kernel arguments
def kernel_args(inputs, opts, token_out=TokenOut.LOSS, need_entropy_grad=True):
    """The kernel's arguments for ``policy_loss(**inputs, **opts)``, built as the op layer does."""
    opts = dict(opts)
    o = ops._resolve(opts.pop("preset", None), None, **opts)
    x = ops._validate(
        inputs["logprobs"],
        inputs["old_logprobs"],
        inputs["advantages"],
        inputs.get("mask"),
        inputs.get("ref_logprobs"),
        inputs.get("rollout_logprobs"),
        inputs.get("entropy"),
        inputs.get("cu_seqlens"),
        o,
        True,
    )
    fparams, iparams = ops._kernel_params(o, x.seq_adv, token_out).pack()
    ent = None if x.entropy is None else x.entropy.detach()
    return [
        x.logprobs.detach(),
        x.old_logprobs,
        x.advantages,
        x.mask,
        x.ref_logprobs,
        x.rollout_logprobs,
        ent,
        x.cu_seqlens,
        x.entropy_threshold,
        fparams,
        iparams,
        need_entropy_grad and ent is not None,
    ]


def expected(inputs, opts):
    """The kernel outputs the fp64 reference implies: sums (Σ agg_w·ℓ and the metric sums),
    agg_w·∂ℓ/∂logp, agg_w·∂ℓ/∂H and the per-token loss ℓ·m."""
    x64 = as_float64(inputs)
    seq_mean = opts.get("agg") == "seq-mean-token-mean"
    lp = x64["logprobs"].clone().requires_grad_(True)
    ent = x64["entropy"].clone().requires_grad_(True)
    kw = dict(x64, logprobs=lp, entropy=ent)
    o = dict(opts, agg="seq-mean-token-mean" if seq_mean else "token-sum")
    loss, met = rk.policy_loss(**kw, **o, backend="reference")
    loss.backward()
    grad_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    n_seq = float(met.num_seqs) if seq_mean else 1.0
    ntok = float(met.num_tokens)
    sums = torch.zeros(NUM_SUMS, dtype=torch.float64)
    sums[S.TOTAL] = float(loss.detach()) * n_seq
    sums[S.PG] = float(met.pg_loss) * n_seq
    sums[S.KL] = float(met.kl_loss) * n_seq
    sums[S.NTOK] = ntok
    sums[S.NSEQ] = float(met.num_seqs)
    for col, name in (
        (S.CLIP, "pg_clipfrac"),
        (S.CLIP_LOWER, "pg_clipfrac_lower"),
        (S.NEG_DELTA, "ppo_kl"),
        (S.KL_RAW, "kl"),
        (S.IS, "is_weight_mean"),
        (S.REJECT, "is_masked_frac"),
        (S.SHAPED, "shaped_frac"),
        (S.ENT, "entropy_mean"),
        (S.CLIP_LOW, "pg_clipfrac_low"),
        (S.CLIP_HIGH, "pg_clipfrac_high"),
    ):
        sums[col] = float(getattr(met, name)) * ntok
    sums[S.IS_MAX] = float(met.is_weight_max)
    sums[S.SEQ_CLIP_LOW] = float(met.seq_clipfrac_low_mean) * float(met.num_seqs)
    sums[S.SEQ_CLIP_HIGH] = float(met.seq_clipfrac_high_mean) * float(met.num_seqs)
    sums[S.SEQ_CLIP_LOW_MIN] = float(met.seq_clipfrac_low_min)
    sums[S.SEQ_CLIP_HIGH_MAX] = float(met.seq_clipfrac_high_max)
    # (these cases reject no token: the count before rejection is NTOK)
    assert float(met.rs_masked_frac) == 0.0 and float(met.rs_seq_masked_frac) == 0.0
    sums[S.NTOK_RAW] = ntok
    sums[S.IS_NORM] = 0.0  # (no batch normalisation in these cases)
    assert float(met.is_batch_norm_factor) == 1.0
    token_loss, _ = rk.policy_loss(**x64, **dict(opts, agg="none"), backend="reference")
    return sums, lp.grad * n_seq, grad_ent * n_seq, token_loss.detach()


def assert_close(actual, want, tol, what):
    want = want.double().cpu()
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(actual.double().cpu(), want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


CASES = [
    (
        "ppo verl dual clip, k3, token_tis",
        {},
        dict(preset="verl", clip_high=0.28, kl="k3", kl_coef=0.1, rollout_correction="token_tis", entropy_coef=0.01),
    ),
    (
        "ppo trl k3 kl_ratio_correction seq-mean",
        {},
        dict(
            preset="trl",
            clip_low=0.1,
            clip_high=0.1,
            kl="k3",
            kl_coef=0.2,
            kl_ratio_correction=True,
            agg="seq-mean-token-mean",
        ),
    ),
    (
        "gspo k3 kl_ratio_correction, packed",
        dict(layout="packed"),
        dict(loss_type="gspo", clip_low=0.02, clip_high=0.02, kl="k3", kl_coef=0.1, kl_ratio_correction=True),
    ),
    (
        "gspo dual clip fp64",
        dict(dtype=torch.float64),
        dict(loss_type="gspo", clip_low=0.01, clip_high=0.01, clip_ratio_c=1.02, gspo_dual_clip=True),
    ),
    (
        "gspo seq_tis seq-mean, packed bf16",
        dict(layout="packed", dtype=torch.bfloat16),
        dict(loss_type="gspo", rollout_correction="seq_tis", agg="seq-mean-token-mean", kl="k1", kl_coef=0.2),
    ),
    (
        "cispo k3+ token_mis fp64",
        dict(dtype=torch.float64),
        dict(loss_type="cispo", clip_high=4.0, kl="k3+", kl_coef=0.1, rollout_correction="token_mis"),
    ),
    (
        "sapo decoupled entropy, packed",
        dict(layout="packed"),
        dict(loss_type="sapo", rollout_correction="decoupled", entropy_coef=0.05),
    ),
    (
        "reinforce k2 seq_mis shaping, token advantages",
        dict(token_adv=True),
        dict(
            loss_type="reinforce",
            kl="k2",
            kl_coef=0.2,
            rollout_correction="seq_mis",
            shaping=TokenShaping(
                w_pos=0.3,
                probability=0.5,
                a3po_metric="entropy",
                a3po_pos_high=(0.3, 2.0),
                a3po_neg_low=(0.2, 0.5),
                entropy_quantile=0.6,
            ),
        ),
    ),
]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float64: 1e-12}


# ------------------------------------------------------------------ contract: values
@pytest.mark.parametrize("which,device", [CPP, TRITON])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_outputs_match_fp64_reference(which, device, case):
    _, case_kw, opts = case
    gen = torch.Generator().manual_seed(11)
    inputs = random_policy_case(gen, B=5, L=19, device=device, **case_kw)
    dtype = inputs["logprobs"].dtype
    sums, grad, grad_ent, tok = kernel(which)(*kernel_args(inputs, opts))
    want_sums, want_grad, want_grad_ent, want_tok = expected(inputs, opts)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    assert sums.dtype == grad.dtype == grad_ent.dtype == tok.dtype == cdt
    assert sums.shape == (NUM_SUMS,) and grad.shape == grad_ent.shape == tok.shape == inputs["logprobs"].shape
    assert float(sums[S.NONFINITE]) == 0.0
    for col in S:
        # (the reference's metrics are fp32: the metric sums are compared at that precision)
        tol = TOL[dtype] if col == S.TOTAL else max(TOL[dtype], 1e-6)
        assert_close(sums[col], want_sums[col], tol, f"sums[{col.name}]")
    assert_close(grad, want_grad, TOL[dtype], "grad_logprobs")
    assert_close(grad_ent, want_grad_ent, TOL[dtype], "grad_entropy")
    assert_close(tok, want_tok, TOL[dtype], "token_out")


@pytest.mark.parametrize("which,device", [CPP, TRITON])
def test_shaped_advantages_and_optional_outputs(which, device):
    gen = torch.Generator().manual_seed(12)
    for layout in ("padded", "packed"):
        inputs = random_policy_case(gen, B=6, L=17, layout=layout, device=device)
        sh = TokenShaping(w_neg=0.5, probability=0.7, a3po_pos_low=(0.3, 3.0), entropy_quantile=0.5)
        opts = dict(loss_type="reinforce", shaping=sh)
        args = kernel_args(inputs, opts, token_out=TokenOut.SHAPED_ADVANTAGES, need_entropy_grad=False)
        sums, grad, grad_ent, tok = kernel(which)(*args)
        want = rk.shape_token_advantages(
            inputs["advantages"].double(),
            inputs["old_logprobs"].double(),
            inputs["mask"],
            sh,
            entropy=inputs["entropy"],
            cu_seqlens=inputs.get("cu_seqlens"),
            backend="reference",
        )
        assert_close(tok, want, 2e-6, f"shaped advantages ({layout})")
        assert grad_ent.shape == (0,)
        # TokenOut.NONE: no token output.
        args = kernel_args(inputs, opts, token_out=TokenOut.NONE, need_entropy_grad=False)
        assert kernel(which)(*args)[3].shape == (0,)


def reference_is_weights_and_keep(inputs, rc):
    """TokenOut.IS_WEIGHTS and KEEP as the contract defines them, from the reference's stages in
    the inputs' compute dtype (the kernels' rounding: the same rejection decisions)."""
    cu = inputs.get("cu_seqlens")
    lp = inputs["logprobs"]
    valid0 = ref_pl._valid_padded(lp, inputs.get("mask"), cu)
    lp, old, roll = (ref_pl.to_padded(inputs[k], cu).float() for k in ("logprobs", "old_logprobs", "rollout_logprobs"))
    x = ref_pl.rc_log_ratio(rc, lp, old, roll)
    keep = valid0 & ref_pl.rejection_keep(rc, x, valid0)
    is_w = torch.ones_like(x)  # (no IS weight: 1)
    if rc.is_level is not None:
        is_w, _ = ref_pl.is_weights(rc, x, valid0.float())
    if rc.is_level is not None and rc.is_batch_normalize:
        is_w = is_w / ref_pl.is_batch_norm(rc, is_w, valid0)
    w = torch.where(valid0, is_w, 0.0)  # (on the valid tokens before rejection, as verl's weights)
    T = inputs["logprobs"].shape[0]
    return ref_pl.from_padded(w, cu, T), ref_pl.from_padded(keep.float(), cu, T)


@pytest.mark.parametrize("which,device", [CPP, TRITON])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_is_weights_and_keep_outputs(which, device, layout):
    gen = torch.Generator().manual_seed(15)
    inputs = random_policy_case(gen, B=5, L=13, layout=layout, device=device)
    for rc in (
        rk.RolloutCorrection(
            "token",
            1.5,
            0.6,
            "icepop",
            rs="token_k2,seq_mean_k1",
            rs_threshold="0.05,0.8_1.25",
            is_batch_normalize=True,
        ),
        rk.RolloutCorrection(
            "sequence", 3.0, 0.4, "icepop", rs="seq_max_k3", rs_threshold=0.1, is_batch_normalize=True
        ),
        rk.RolloutCorrection(rs="token_k1", rs_threshold="0.7_1.4", log_ratio="current"),  # weight 1
    ):
        want_w, want_keep = reference_is_weights_and_keep(dict(inputs), rc)
        assert 0 < float(want_keep.sum()) < float(inputs["mask"].sum())  # part of the batch rejected
        for token_out, want in ((TokenOut.IS_WEIGHTS, want_w), (TokenOut.KEEP, want_keep)):
            tok = kernel(which)(*kernel_args(inputs, dict(rollout_correction=rc), token_out=token_out))[3]
            assert_close(tok, want, 2e-6, f"{token_out.name} ({layout}, {rc})")


@pytest.mark.parametrize("which,device", [CPP, TRITON])
def test_empty_inputs(which, device):
    for B, L, layout in ((0, 5, "padded"), (3, 0, "padded"), (0, 0, "packed"), (4, 0, "packed")):
        lp = torch.zeros((B, L) if layout == "padded" else (B * L,), device=device)
        inputs = dict(logprobs=lp, old_logprobs=lp, advantages=torch.ones(B, device=device))
        if layout == "padded":
            inputs["mask"] = torch.zeros(B, L, dtype=torch.bool, device=device)
        else:
            inputs["cu_seqlens"] = torch.zeros(B + 1, dtype=torch.int64, device=device)
        for opts in (dict(), dict(loss_type="gspo", agg="seq-mean-token-mean")):
            sums, grad, _, tok = kernel(which)(*kernel_args(inputs, opts))
            assert torch.equal(sums.cpu(), torch.zeros(NUM_SUMS)) and grad.shape == tok.shape == lp.shape


# ------------------------------------------------------------------ contract: garbage offsets
def garbage_offsets(gen, B, T):
    """cu_seqlens that validation would refuse: out of range, decreasing, huge."""
    cu = torch.randint(-T, 2 * T + 2, (B + 1,), generator=gen)
    cu[torch.randint(0, B + 1, (2,), generator=gen)] = torch.tensor([2**40, -(2**62)])
    return cu


@pytest.mark.parametrize("which,device", [CPP, TRITON])
def test_garbage_cu_seqlens_give_the_sanitised_spans(which, device):
    """Whatever cu_seqlens holds, the kernel reads and writes in bounds: its outputs are those
    of the sanitised offsets (disjoint spans inside [0, T])."""
    gen = torch.Generator().manual_seed(13)
    trials = 6 if which == "cpp" or DEVICE == "cuda" else 2
    option_sets = (
        dict(kl="k3", kl_coef=0.1, rollout_correction="token_tis"),
        dict(loss_type="gspo", rollout_correction="seq_mis", agg="seq-mean-token-mean"),
        dict(shaping=TokenShaping(a3po_pos_high=(0.3, 2.0), a3po_neg_low=(0.2, 0.5), entropy_quantile=0.5)),
    )
    for trial in range(trials):
        inputs = random_policy_case(gen, B=7, L=11, layout="packed", device=device)
        T = inputs["logprobs"].shape[0]
        cu = garbage_offsets(gen, 7, T).to(device)
        if trial % 2:
            inputs.pop("mask")
        for opts in option_sets:
            args = kernel_args(inputs, opts)
            args[7] = cu
            got = kernel(which)(*args)
            args[7] = sanitized_offsets(cu, T)
            want = kernel(which)(*args)
            for g, w in zip(got, want):
                assert torch.equal(g, w)
            assert torch.isfinite(got[0]).all()


# ------------------------------------------------------------------ the registered C++ op
def small_case(layout="padded", **kw):
    gen = torch.Generator().manual_seed(14)
    return random_policy_case(gen, B=4, L=9, layout=layout, **kw)


ALL_ON = dict(
    loss_type="ppo",
    kl="k3",
    kl_coef=0.1,
    rollout_correction="token_tis",
    entropy_coef=0.01,
    shaping=TokenShaping(a3po_metric="entropy", a3po_pos_high=(0.3, 2.0), entropy_quantile=0.5),
)


def replace_param(args, **fields):
    """The arguments with some kernel parameters replaced (raw ints: unknown codes allowed)."""
    p = PolicyLossParams.unpack(args[9], args[10])
    fparams, iparams = p.pack()
    for name, value in fields.items():
        if name in PolicyLossParams.float_fields():
            fparams[PolicyLossParams.float_fields().index(name)] = value
        else:
            iparams[PolicyLossParams.int_fields().index(name)] = value
    return args[:9] + [fparams, iparams] + args[11:]


_COUNTS = (
    f"PolicyLossParams: expected {len(PolicyLossParams.float_fields())} fparams and "
    f"{len(PolicyLossParams.int_fields())} iparams"
)


@pytest.mark.cpu_kernel
def test_cpp_op_checks_parameter_lists():
    args = kernel_args(small_case(), ALL_ON)
    K.policy_loss_fwd(*args)
    with pytest.raises(
        RuntimeError,
        match=_COUNTS,
    ):
        K.policy_loss_fwd(*args[:9], args[9] + [1.0], *args[10:])
    with pytest.raises(RuntimeError, match="PolicyLossParams"):
        K.policy_loss_fwd(*args[:10], args[10][:-1], *args[11:])
    for field, bad in (
        ("loss_type", 99),
        ("kl", -1),
        ("rollout_correction", len(RolloutCorrectionCode)),
        ("token_out", len(TokenOut)),
        ("a3po_metric", 2),
    ):
        with pytest.raises(RuntimeError, match=f"unknown {field}"):
            K.policy_loss_fwd(*replace_param(args, **{field: bad}))


def mutate(args, **changes):
    names = ops._FwdArgs._fields[:12]
    out = list(args)
    for name, value in changes.items():
        out[names.index(name)] = value
    return out


@pytest.mark.cpu_kernel
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cpp_op_checks_every_shape_relation(layout):
    inputs = small_case(layout)
    args = kernel_args(inputs, ALL_ON)
    lp = args[0]
    T = lp.shape[0]
    bad = {
        "old_logprobs": [lp[:-1], lp.double(), lp.unsqueeze(0)],
        "ref_logprobs": [None, lp[:-1], lp.half()],
        "rollout_logprobs": [None, lp[:-1], lp.double()],
        "entropy": [None, lp[:-1], lp.double()],
        "mask": [torch.ones(lp.numel() + 1, dtype=torch.bool)],
        "advantages": [torch.zeros(T + 3), torch.zeros(2, 2), torch.zeros(lp.shape)],
        "entropy_threshold": [None, torch.zeros(2)],
        "logprobs": [lp.unsqueeze(0), lp.long()],
    }
    if layout == "padded":
        bad["mask"] += [None, torch.ones(lp.shape[0], lp.shape[1] + 1, dtype=torch.bool)]
        bad["logprobs"].append(lp.flatten())
        bad["cu_seqlens"] = [torch.tensor([0, lp.numel()])]  # a padded [B, L] with offsets
    else:
        bad["cu_seqlens"] = [
            None,
            torch.zeros(2, 2, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(5),
        ]
    for name, values in bad.items():
        for value in values:
            with pytest.raises(RuntimeError, match="policy_loss_fwd|PolicyLossParams"):
                K.policy_loss_fwd(*mutate(args, **{name: value}))
    # Token advantages with [B] advantages declared, and the reverse.
    with pytest.raises(RuntimeError, match="advantages"):
        K.policy_loss_fwd(*replace_param(mutate(args, advantages=torch.zeros(lp.shape)), seq_adv=1))
    with pytest.raises(RuntimeError, match="advantages"):
        K.policy_loss_fwd(*replace_param(args, seq_adv=0))
    with pytest.raises(RuntimeError, match="entropy"):
        K.policy_loss_fwd(*mutate(args, entropy=None, need_entropy_grad=True))


@pytest.mark.cpu_kernel
def test_cpp_op_accepts_what_it_can_read_safely():
    """Strided, expanded and non-bool inputs are made contiguous / bool by the kernel."""
    inputs = small_case()
    args = kernel_args(inputs, dict(kl="k3", kl_coef=0.1))
    want = K.policy_loss_fwd(*args)
    B, L = args[0].shape
    nc = [a.t().contiguous().t() if isinstance(a, torch.Tensor) and a.dim() == 2 else a for a in args]
    for g, w in zip(K.policy_loss_fwd(*nc), want):
        assert torch.equal(g, w)
    got = K.policy_loss_fwd(*mutate(args, mask=args[3].float()))
    assert torch.equal(got[0], want[0])
    ones = torch.ones(1, L, dtype=torch.bool).expand(B, L)  # stride 0
    got = K.policy_loss_fwd(*mutate(args, mask=ones))
    assert got[0][S.NTOK] == B * L
    # A ref_logprobs the options do not read is not read (not even by the value check).
    nan = torch.full_like(args[0], float("nan"))
    args = kernel_args(inputs, dict())
    assert float(K.policy_loss_fwd(*mutate(args, ref_logprobs=nan, rollout_logprobs=nan))[0][S.NONFINITE]) == 0


@pytest.mark.cpu_kernel
def test_cpp_op_survives_hostile_parameters():
    """Values no options object can produce (a3po ratios outside [0, 1], NaN and infinite
    bounds) give garbage numbers, never an out-of-bounds access or undefined behaviour."""
    for layout in ("padded", "packed"):
        args = kernel_args(small_case(layout), ALL_ON)
        for value in (float("inf"), float("nan"), 1e300, -5.0, 2.0):
            hostile = replace_param(
                args,
                a3po_pos_high_ratio=value,
                a3po_pos_low_ratio=value,
                a3po_neg_high_ratio=value,
                a3po_neg_low_ratio=value,
                a3po_pos_high_scale=2.0,
                a3po_pos_low_scale=2.0,
                a3po_neg_high_scale=2.0,
                a3po_neg_low_scale=2.0,
                a3po=1,
                ratio_low=value,
                rc_high=value,
                tau_pos=value,
                log_ratio_clamp=value,
            )
            K.policy_loss_fwd(*hostile)
            K.policy_loss_fwd(
                *replace_param(
                    hostile,
                    loss_type=int(LossType.GSPO),
                    seq_mean=1,
                    kl=int(KlEstimator.K3_PLUS),
                    rollout_correction=int(RolloutCorrectionCode.SEQ_MIS),
                )
            )


@pytest.mark.cpu_kernel
def test_cpp_grad_op_checks_shapes():
    coef = torch.randn(3, 5)
    assert torch.equal(K.policy_loss_grad(coef, torch.tensor(2.0), torch.float32), coef * 2)
    up = torch.randn(3, 5)
    assert torch.equal(K.policy_loss_grad(coef, up, torch.bfloat16), (coef * up).bfloat16())
    for c, u, dt in (
        (coef, torch.randn(3, 4), torch.float32),
        (coef, torch.randn(15), torch.float32),
        (coef.t(), torch.randn(5, 3), torch.float32),
        (coef.long(), torch.ones(()), torch.float32),
        (coef, torch.ones((), dtype=torch.long), torch.float32),
        (coef, torch.ones(()), torch.long),
        (coef, torch.randn(3, 10)[:, ::2], torch.float32),
    ):
        with pytest.raises(RuntimeError, match="policy_loss_grad"):
            K.policy_loss_grad(c, u, dt)


# ------------------------------------------------------------------ the Triton launcher
def test_triton_launcher_checks_parameter_lists_and_shapes():
    args = kernel_args(small_case(device=DEVICE), dict(kl="k3", kl_coef=0.1, rollout_correction="token_tis"))
    f = triton_policy_loss.policy_loss_fwd
    with pytest.raises(ValueError, match=_COUNTS):
        f(*args[:9], args[9][:-1], *args[10:])
    with pytest.raises(ValueError, match="is not a valid LossType"):
        f(*replace_param(args, loss_type=99))
    lp = args[0]
    for name, value in (
        ("old_logprobs", lp[:, :-1]),
        ("ref_logprobs", None),
        ("rollout_logprobs", lp.double()),
        ("mask", None),
        ("advantages", torch.zeros(lp.shape[0] + 1, device=DEVICE)),
        ("logprobs", lp.flatten()),
    ):
        with pytest.raises(RuntimeError, match="policy_loss_fwd"):
            f(*mutate(args, **{name: value}))
    # cov_selection: read by clip_cov / kl_cov only, required there, bool and token-shaped
    sel = torch.zeros_like(lp, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="cov_selection is only read by"):
        f(*args, sel)
    cov = kernel_args(small_case(device=DEVICE), dict(loss_type="kl_cov"))
    with pytest.raises(RuntimeError, match="cov_selection is required by"):
        f(*cov)
    for bad in (sel.float(), sel[:, :-1]):
        with pytest.raises(RuntimeError, match="cov_selection must have"):
            f(*cov, bad)
    assert torch.isfinite(f(*cov, sel)[0]).all()


@pytest.mark.cpu_kernel
def test_baseline_isa_build():
    """The 16-byte-vector C++ build (what runs without AVX2), in a subprocess: the choice is
    made once per process."""
    code = (
        "import sys, torch\n"
        f"sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]\n"
        "import conftest, test_kernel as t\n"
        "for case in t.CASES:\n"
        "    t.test_outputs_match_fp64_reference('cpp', 'cpu', case)\n"
        "t.test_garbage_cu_seqlens_give_the_sanitised_spans('cpp', 'cpu')\n"
    )
    env = dict(os.environ, RLVR_KERNELS_CPU_NO_AVX2="1")
    res = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
