"""clip_cov / kl_cov on the C++ and Triton kernels: values and gradients against the formulas
written in torch on the same covariance selection and against the fp64 reference (padded,
packed, fp32 / bf16 / fp64, empty, all-masked, no candidates), the selection's determinism,
the caller's cov_selection= and the option checks."""

import pytest
import torch
from _backends import ALL, FAST

import rlvr_kernels as rk
from rlvr_kernels.contracts.policy_loss import LossType, cov_selection
from rlvr_kernels.testing import as_float64, compare_policy, random_policy_case, run_policy_loss, upstream_for
from rlvr_kernels.testing.policy_loss import reduction_magnitudes

KW = dict(cov_lb=-1.0, cov_ub=1.0, clip_low=0.2, clip_high=0.28, log_ratio_clamp=0.0, cov_seed=3)


def batch(seed, B=6, L=37):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, L, generator=g) * 2
    old = lp + 0.3 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, L, generator=g) * 2
    mask = torch.rand(B, L, generator=g) > 0.2
    return lp, old, adv, mask


def torch_loss(loss_type, lp, old, adv, mask, sel, coef=1.0):
    r = torch.exp(lp - old)
    if loss_type == "clip_cov":
        t = torch.maximum(-adv * r, -adv * r.clamp(1 - KW["clip_low"], 1 + KW["clip_high"])) * (~sel)
    else:
        t = -adv * r + torch.where(sel, coef * (lp - old).abs(), 0.0)  # coef stays a python float
    return (t * mask).sum() / mask.sum()


def cov_options(loss_type):
    """The options of KW (and cov_ratio 0.1, kl_cov_coef 0.7) for policy_loss."""
    return rk.PolicyLossOptions(
        loss_type=loss_type,
        cov_ratio=0.1,
        cov_lb=KW["cov_lb"],
        cov_ub=KW["cov_ub"],
        clip_high=KW["clip_high"],
        log_ratio_clamp=None,
        cov_seed=KW["cov_seed"],
        kl_cov_coef=0.7,
    )


@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_values_and_gradients_match_torch(loss_type, seed):
    lp, old, adv, mask = batch(seed)
    lt = LossType.CLIP_COV if loss_type == "clip_cov" else LossType.KL_COV
    sel = cov_selection(lt, lp, old, adv, mask, cov_ratio=0.1, **KW)
    assert int(sel.sum()) > 0 and not bool((sel & ~mask).any())
    o = cov_options(loss_type)
    x = lp.clone().requires_grad_(True)
    loss, met = rk.policy_loss(x, old, adv, mask, options=o, backend="cpu")
    (g,) = torch.autograd.grad(loss, x)
    x64 = lp.double().requires_grad_(True)
    want = torch_loss(loss_type, x64, old.double(), adv.double(), mask, sel, coef=0.7)
    (g64,) = torch.autograd.grad(want, x64)
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6)
    assert torch.allclose(g.double(), g64, atol=1e-6)
    assert float(met.pg_clipfrac) == pytest.approx(float(sel[mask].float().mean()))
    if loss_type == "kl_cov":
        assert float(met.ppo_kl) == pytest.approx(float((lp - old).abs()[mask].mean()), rel=1e-5)


def test_selection_is_deterministic_and_seeded():
    lp, old, adv, mask = batch(5, B=16, L=64)
    a = cov_selection(LossType.CLIP_COV, lp, old, adv, mask, cov_ratio=0.05, **KW)
    b = cov_selection(LossType.CLIP_COV, lp.double(), old.double(), adv.double(), mask, cov_ratio=0.05, **KW)
    assert torch.equal(a, b)
    c = cov_selection(LossType.CLIP_COV, lp, old, adv, mask, cov_ratio=0.05, **dict(KW, cov_seed=4))
    assert int(a.sum()) == int(c.sum()) and not torch.equal(a, c)
    k = cov_selection(LossType.KL_COV, lp, old, adv, mask, cov_ratio=0.05, **KW)
    assert int(k.sum()) == max(1, int(int(mask.sum()) * 0.05))
    # ties: the lower flat index first
    tie = cov_selection(
        LossType.KL_COV,
        torch.zeros(1, 6),
        torch.zeros(1, 6),
        torch.zeros(1, 6),
        torch.ones(1, 6, dtype=torch.bool),
        cov_ratio=0.5,
        **KW,
    )
    assert tie.tolist() == [[True, True, True, False, False, False]]


@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
def test_given_selection_and_empty(loss_type):
    lp, old, adv, mask = batch(7)
    given = torch.zeros_like(mask)
    given[0, :3] = True
    o = rk.PolicyLossOptions(loss_type=loss_type, log_ratio_clamp=None, clip_high=0.28)
    loss, _ = rk.policy_loss(lp, old, adv, mask, options=o, cov_selection=given, backend="cpu")
    want = torch_loss(loss_type, lp.double(), old.double(), adv.double(), mask, given)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    x = lp.clone().requires_grad_(True)
    loss, met = rk.policy_loss(x, old, adv, torch.zeros_like(mask), options=o, backend="cpu")
    loss.backward()
    assert float(loss) == 0.0 and float(x.grad.abs().sum()) == 0.0 and float(met.pg_clipfrac) == 0.0
    with pytest.raises(ValueError, match="cov_selection"):
        rk.policy_loss(lp, old, adv, mask, cov_selection=given, backend="cpu")


def test_options_checked():
    for field, bad in (("cov_ratio", 0.0), ("cov_ratio", 1.5), ("cov_lb", 6.0), ("kl_cov_coef", float("nan"))):
        with pytest.raises(ValueError, match=field):
            rk.PolicyLossOptions(loss_type="clip_cov", **{field: bad})
    with pytest.raises(TypeError, match="cov_seed"):
        rk.PolicyLossOptions(loss_type="clip_cov", cov_seed=1.5)


def assert_backend_matches_reference(inputs, options, gen, backend="cpu"):
    """The tolerance rule: a fast backend against the fp64 reference, the same-dtype reference
    as scale."""
    opts = {"options": rk.PolicyLossOptions(**options)}
    up = upstream_for(inputs, options, gen)
    ref64 = run_policy_loss(as_float64(inputs), opts, "reference", up)
    same = run_policy_loss(inputs, opts, "reference", up)
    fast = run_policy_loss(inputs, opts, backend, up)
    sums = reduction_magnitudes(inputs, opts)
    bad = [c for c in compare_policy(fast, ref64, same, inputs["logprobs"].dtype, sums) if not c.ok]
    assert not bad, bad
    return fast, ref64


COV_OPTS = [
    dict(loss_type="clip_cov", cov_ratio=0.1, cov_lb=-2.0, cov_ub=2.0, cov_seed=5, log_ratio_clamp=None),
    dict(loss_type="clip_cov", cov_ratio=0.3, clip_high=0.28, agg="seq-mean-token-mean"),
    dict(loss_type="kl_cov", cov_ratio=0.1, kl_cov_coef=0.7, log_ratio_clamp=None),
    dict(loss_type="kl_cov", cov_ratio=0.05, kl_cov_coef=1.5, agg="none", kl="k3", kl_coef=0.1),
]


@pytest.mark.cpu_kernel
@pytest.mark.parametrize("opts", COV_OPTS, ids=lambda o: f"{o['loss_type']}-{o['cov_ratio']}")
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("token_adv", [False, True])
def test_cpu_matches_reference(opts, layout, dtype, token_adv):
    gen = torch.Generator().manual_seed(11 + 7 * token_adv)
    inputs = random_policy_case(gen, B=9, L=41, layout=layout, dtype=dtype, token_adv=token_adv)
    fast, ref64 = assert_backend_matches_reference(inputs, opts, gen)
    assert float(ref64["metric.pg_clipfrac"]) > 0  # some tokens are selected


# Triton (interpreted on CPU machines: seconds per call): a few of the cases above, odd sizes.
TRITON = [p for p in FAST if p.values[0] == "triton"]


@pytest.mark.parametrize("backend,device", TRITON)
@pytest.mark.parametrize("opts", COV_OPTS[1:], ids=lambda o: f"{o['loss_type']}-{o['cov_ratio']}")
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_triton_matches_reference(backend, device, opts, layout):
    gen = torch.Generator().manual_seed(12)
    dtype = torch.bfloat16 if layout == "packed" else torch.float32
    inputs = random_policy_case(gen, B=7, L=23, layout=layout, dtype=dtype, token_adv=layout == "padded", device=device)
    fast, ref64 = assert_backend_matches_reference(inputs, opts, gen, backend)
    assert float(ref64["metric.pg_clipfrac"]) > 0


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
def test_reference_matches_formulas(backend, device, loss_type):
    lp, old, adv, mask = batch(4)
    lt = LossType.CLIP_COV if loss_type == "clip_cov" else LossType.KL_COV
    sel = cov_selection(lt, lp, old, adv, mask, cov_ratio=0.1, **KW)
    o = cov_options(loss_type)
    x = lp.double().to(device).requires_grad_(True)
    dev = (old.double().to(device), adv.double().to(device), mask.to(device))
    loss, met = rk.policy_loss(x, *dev, options=o, backend=backend)
    (g,) = torch.autograd.grad(loss, x)
    x64 = lp.double().requires_grad_(True)
    want = torch_loss(loss_type, x64, old.double(), adv.double(), mask, sel, coef=0.7)
    (g64,) = torch.autograd.grad(want, x64)
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-10)
    assert torch.allclose(g.cpu(), g64, atol=1e-12)
    assert float(met.pg_clipfrac) == pytest.approx(float(sel[mask].double().mean()))
    if loss_type == "kl_cov":
        assert float(met.ppo_kl) == pytest.approx(float((lp - old).abs()[mask].double().mean()), rel=1e-6)
    given = torch.zeros_like(mask)
    given[1, :4] = True
    dev = (lp.to(device), old.to(device), adv.to(device), mask.to(device))
    loss, _ = rk.policy_loss(*dev, options=o, cov_selection=given.to(device), backend=backend)
    want = torch_loss(loss_type, lp.double(), old.double(), adv.double(), mask, given, coef=0.7)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("case", ["empty", "all_masked", "no_candidates"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_edge_cases_match_reference(backend, device, loss_type, case, layout):
    gen = torch.Generator().manual_seed(21)
    B = 0 if case == "empty" else 5
    inputs = random_policy_case(gen, B=B, L=17, layout=layout, device=device)
    if case == "all_masked":
        inputs["mask"] = torch.zeros_like(inputs["mask"])
    opts = dict(loss_type=loss_type, cov_ratio=0.2)
    if case == "no_candidates":  # an empty covariance window: clip_cov selects nothing
        opts.update(cov_lb=4.0, cov_ub=4.5)
    fast, ref64 = assert_backend_matches_reference(inputs, opts, gen, backend)
    for out in (fast, ref64):
        assert all(bool(torch.isfinite(v).all()) for v in out.values())
    if case != "no_candidates" or loss_type == "clip_cov":
        assert float(fast["metric.pg_clipfrac"]) == 0.0
    if case != "no_candidates":
        assert float(fast["loss"].abs().sum()) == 0.0 and float(fast["grad.logprobs"].abs().sum()) == 0.0
