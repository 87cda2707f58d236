"""clip_cov / kl_cov on the C++ kernel: values and gradients against the formulas written
in torch on the same covariance selection, the selection's determinism, the caller's
cov_selection= and the option checks."""

import pytest
import torch

import rlvr_kernels as rk
from rlvr_kernels.contracts.policy_loss import LossType, cov_selection

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
        t = -adv * r + coef * sel * (lp - old).abs()
    return (t * mask).sum() / mask.sum()


@pytest.mark.parametrize("loss_type", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_values_and_gradients_match_torch(loss_type, seed):
    lp, old, adv, mask = batch(seed)
    lt = LossType.CLIP_COV if loss_type == "clip_cov" else LossType.KL_COV
    sel = cov_selection(lt, lp, old, adv, mask, cov_ratio=0.1, **KW)
    assert int(sel.sum()) > 0 and not bool((sel & ~mask).any())
    o = rk.PolicyLossOptions(
        loss_type=loss_type,
        cov_ratio=0.1,
        cov_lb=-1.0,
        cov_ub=1.0,
        clip_high=0.28,
        log_ratio_clamp=None,
        cov_seed=3,
        kl_cov_coef=0.7,
    )
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
