"""policy_loss and shape_token_advantages against hand-computed values (docs/token-shaping.md, docs/policy-loss.md), on
every backend: the seed's teaching values, each loss type with clipping active on each
side, KL estimators, rollout corrections, aggregations and the empty cases."""

import math

import pytest
import torch
from _backends import ALL

import rlvr_kernels as rk
from rlvr_kernels import TokenShaping


def one_token(backend, device, *, logp, old, adv, **opts):
    """Loss and d loss / d logp for one valid token (token-mean = the token's loss)."""
    lp = torch.tensor([[logp]], dtype=torch.float64, device=device, requires_grad=True)
    o = torch.tensor([[old]], dtype=torch.float64, device=device)
    a = torch.tensor([adv], dtype=torch.float64, device=device)
    m = torch.ones(1, 1, dtype=torch.bool, device=device)
    extra = {
        k: torch.tensor([[v]], dtype=torch.float64, device=device)
        for k, v in opts.items()
        if k in ("ref_logprobs", "rollout_logprobs")
    }
    kw = {k: v for k, v in opts.items() if k not in extra}
    loss, metrics = rk.policy_loss(lp, o, a, m, **extra, **kw, backend=backend)
    loss.backward()
    return float(loss.detach()), float(lp.grad[0, 0]), metrics


L08 = math.log(0.8)


@pytest.mark.parametrize("backend,device", ALL)
def test_teaching_values(backend, device):
    # The seed's illustrative token advantage: A=1, p=0.2 -> 0.8; A=-1, p=0.8 -> -0.8.
    adv = torch.tensor([1.0, -1.0], device=device)
    old = torch.tensor([[0.2], [0.8]], device=device).log()
    m = torch.ones(2, 1, dtype=torch.bool, device=device)
    out = rk.shape_token_advantages(adv, old, m, TokenShaping(probability=1.0), backend=backend)
    torch.testing.assert_close(out.cpu(), torch.tensor([[0.8], [-0.8]]), rtol=0, atol=1e-6)
    # Half strength: (1 - λ) + λ·w.
    out = rk.shape_token_advantages(adv, old, m, TokenShaping(probability=0.5), backend=backend)
    torch.testing.assert_close(out.cpu(), torch.tensor([[0.9], [-0.9]]), rtol=0, atol=1e-6)
    # W-REINFORCE polarity weights.
    out = rk.shape_token_advantages(adv, old, m, TokenShaping(w_pos=0.1), backend=backend)
    torch.testing.assert_close(out.cpu(), torch.tensor([[0.1], [-1.0]]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize(
    "adv,ratio,expect_loss,expect_grad,clipped",
    [
        (1.0, 1.5, -1.2, 0.0, True),  # A > 0, ratio above 1 + ε_high: clipped, no gradient
        (1.0, 0.5, -0.5, -0.5, False),  # A > 0, ratio below 1 − ε: the unclipped branch is the max
        (-1.0, 0.5, 0.8, 0.0, True),  # A < 0, ratio below 1 − ε: clipped
        (-1.0, 2.0, 2.0, 2.0, False),  # A < 0, inside the dual clip: −Aρ, gradient −Aρ
        (-1.0, 4.0, 3.0, 0.0, False),  # A < 0, beyond c = 3: dual clip −A·c, no gradient
        (2.0, 1.1, -2.2, -2.2, False),  # inside the trust region
    ],
)
def test_ppo_clipping_each_side(backend, device, adv, ratio, expect_loss, expect_grad, clipped):
    loss, grad, met = one_token(backend, device, logp=math.log(ratio) - 1.0, old=-1.0, adv=adv, preset="verl")
    assert loss == pytest.approx(expect_loss, abs=1e-9)
    assert grad == pytest.approx(expect_grad, abs=1e-9)
    assert float(met.pg_clipfrac) == (1.0 if clipped else 0.0)
    assert float(met.pg_clipfrac_lower) == (1.0 if ratio > 3 and adv < 0 else 0.0)
    assert float(met.ppo_kl) == pytest.approx(-math.log(ratio), rel=1e-6)


@pytest.mark.parametrize("backend,device", ALL)
def test_clip_higher(backend, device):
    # DAPO's ε_high = 0.28: ratio 1.25 is inside for A > 0.
    loss, grad, _ = one_token(backend, device, logp=math.log(1.25), old=0.0, adv=1.0, clip_high=0.28)
    assert (loss, grad) == (pytest.approx(-1.25), pytest.approx(-1.25))
    loss, grad, _ = one_token(backend, device, logp=math.log(1.25), old=0.0, adv=1.0, clip_high=0.2)
    assert (loss, grad) == (pytest.approx(-1.2), pytest.approx(0.0))


@pytest.mark.parametrize("backend,device", ALL)
def test_gspo_sequence_ratio(backend, device):
    # One sequence, δ = (0.4, 0.6): log s = 0.5, s = e^0.5 ≈ 1.649 > 1.2.
    lp = torch.tensor([[0.4, 0.6, 9.0]], dtype=torch.float64, device=device, requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64, device=device)
    m = torch.tensor([[True, True, False]], device=device)
    s = math.exp(0.5)
    for adv, expect, grad in ((1.0, -1.2, 0.0), (-1.0, s, 1.0 * s / 2)):
        lp.grad = None
        loss, met = rk.policy_loss(
            lp,
            old,
            torch.tensor([adv], dtype=torch.float64, device=device),
            m,
            loss_type="gspo",
            agg="seq-mean-token-mean",
            backend=backend,
        )
        loss.backward()
        assert float(loss.detach()) == pytest.approx(expect, abs=1e-9)
        # seq-mean-token-mean: each of the 2 tokens has weight 1/2.
        torch.testing.assert_close(lp.grad.cpu(), torch.tensor([[grad, grad, 0.0]], dtype=torch.float64))
        assert float(met.pg_clipfrac) == (1.0 if adv > 0 else 0.0)


@pytest.mark.parametrize("backend,device", ALL)
def test_cispo_sapo_reinforce(backend, device):
    # CISPO: −sg(clip(ρ))·A·logp; ρ = 1.5 clipped to 1.2.
    loss, grad, met = one_token(backend, device, logp=math.log(1.5) - 1, old=-1.0, adv=1.0, loss_type="cispo")
    assert loss == pytest.approx(-1.2 * (math.log(1.5) - 1))
    assert grad == pytest.approx(-1.2)
    assert float(met.pg_clipfrac) == 1.0
    # SAPO at ρ = 1: σ(0)·4/τ = 2/τ·… with τ_pos = 1: loss −2·A, gradient −4·A·σ(1−σ)·ρ = −A.
    loss, grad, _ = one_token(backend, device, logp=-1.0, old=-1.0, adv=1.0, loss_type="sapo")
    assert (loss, grad) == (pytest.approx(-2.0), pytest.approx(-1.0))
    # SAPO with A < 0 uses τ_neg = 1.05.
    loss, grad, _ = one_token(backend, device, logp=-1.0, old=-1.0, adv=-1.0, loss_type="sapo")
    assert (loss, grad) == (pytest.approx(2.0 / 1.05), pytest.approx(1.0))
    for lt in ("reinforce", "gpg"):
        loss, grad, _ = one_token(backend, device, logp=-0.7, old=-3.0, adv=2.0, loss_type=lt)
        assert (loss, grad) == (pytest.approx(1.4), pytest.approx(-2.0))


@pytest.mark.parametrize("backend,device", ALL)
def test_dppo_values(backend, device):
    """−A·sg(min(ρ, c))·logp on tokens inside the trust region, 0 (and counted in
    pg_clipfrac) outside; pg_clipfrac_lower counts kept tokens above the cap."""
    lp5, lp3 = math.log(0.5), math.log(0.3)  # p − p_old = ±0.2, ρ = 5/3 or 3/5
    kw = dict(loss_type="dppo_tv", clip_ratio_c=1.5)
    loss, grad, met = one_token(backend, device, logp=lp5, old=lp3, adv=1.0, clip_high=0.25, **kw)
    assert (loss, grad) == (pytest.approx(-1.5 * lp5), pytest.approx(-1.5))  # ρ truncated at c
    assert (float(met.pg_clipfrac), float(met.pg_clipfrac_lower)) == (0.0, 1.0)
    loss, grad, met = one_token(backend, device, logp=lp5, old=lp3, adv=1.0, clip_high=0.1, **kw)
    assert (loss, grad) == (0.0, 0.0)
    assert (float(met.pg_clipfrac), float(met.pg_clipfrac_lower)) == (1.0, 0.0)
    loss, grad, _ = one_token(backend, device, logp=lp5, old=lp3, adv=-2.0, clip_high=0.1, **kw)
    assert (loss, grad) == (pytest.approx(3.0 * lp5), pytest.approx(3.0))  # A < 0: only the lower side
    loss, grad, met = one_token(backend, device, logp=lp3, old=lp5, adv=-2.0, clip_low=0.1, **kw)
    assert (loss, grad, float(met.pg_clipfrac)) == (0.0, 0.0, 1.0)
    loss, grad, _ = one_token(backend, device, logp=lp3, old=lp5, adv=-2.0, clip_low=0.25, **kw)
    assert (loss, grad) == (pytest.approx(2.0 * 0.6 * lp3), pytest.approx(1.2))  # ρ = 0.6, no cap
    # Binary KL of (p_old, p) = (0.3, 0.5) with verl's 1e-8 terms.
    kl = 0.3 * (lp3 - lp5) + 0.7 * math.log((0.7 + 1e-8) / (0.5 + 1e-8))
    kw = dict(loss_type="dppo_kl")  # no cap
    loss, grad, met = one_token(backend, device, logp=lp5, old=lp3, adv=1.0, clip_high=1.1 * kl, **kw)
    assert (loss, grad) == (pytest.approx(-lp5 / 0.6), pytest.approx(-1 / 0.6))
    assert float(met.pg_clipfrac) == 0.0
    loss, grad, met = one_token(backend, device, logp=lp5, old=lp3, adv=1.0, clip_high=0.9 * kl, **kw)
    assert (loss, grad, float(met.pg_clipfrac)) == (0.0, 0.0, 1.0)
    # A < 0 and p >= p_old: inside whatever the KL
    loss, _, met = one_token(backend, device, logp=lp5, old=lp3, adv=-1.0, clip_low=0.0, **kw)
    assert loss == pytest.approx(lp5 / 0.6) and float(met.pg_clipfrac) == 0.0


def test_dppo_options_checked():
    """DPPO's thresholds are divergences (any value >= 0), its cap any c > 0."""
    rk.PolicyLossOptions(loss_type="dppo_kl", clip_low=2.0, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        rk.PolicyLossOptions(loss_type="dppo_tv", clip_ratio_c=0.0)
    with pytest.raises(ValueError, match="clip_low"):
        rk.PolicyLossOptions(loss_type="dppo_tv", clip_low=-0.1)
    with pytest.raises(ValueError, match="clip_low"):
        rk.PolicyLossOptions(loss_type="ppo", clip_low=2.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        rk.PolicyLossOptions(loss_type="ppo", clip_ratio_c=0.5)


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize(
    "kind,value,grad",
    [
        ("k1", 0.5, 1.0),
        ("k2", 0.125, 0.5),
        ("k3", math.exp(-0.5) + 0.5 - 1, 1 - math.exp(-0.5)),
        ("k3+", math.exp(-0.5) + 0.5 - 1, 0.5),
    ],
)
def test_kl_estimators(backend, device, kind, value, grad):
    # logp − ref = 0.5, A = 0 (no policy-gradient term), β = 1.
    loss, g, met = one_token(backend, device, logp=-1.0, old=-1.0, adv=0.0, kl=kind, kl_coef=1.0, ref_logprobs=-1.5)
    assert loss == pytest.approx(value, abs=1e-12)
    assert g == pytest.approx(grad, abs=1e-12)
    assert float(met.kl) == pytest.approx(value, abs=1e-6)


@pytest.mark.parametrize("backend,device", ALL)
def test_k3_clamps(backend, device):
    # ref − logp = 30: verl clamps x to 20 and the value to 10 (no gradient); TRL does not.
    loss, g, _ = one_token(
        backend, device, logp=-31.0, old=-31.0, adv=0.0, kl="k3", kl_coef=1.0, ref_logprobs=-1.0, preset="verl"
    )
    assert (loss, g) == (10.0, 0.0)
    loss, g, _ = one_token(
        backend, device, logp=-4.0, old=-4.0, adv=0.0, kl="k3", kl_coef=1.0, ref_logprobs=-1.0, preset="trl"
    )
    assert loss == pytest.approx(math.exp(3) - 3 - 1)
    assert g == pytest.approx(1 - math.exp(3))


@pytest.mark.parametrize("backend,device", ALL)
def test_rollout_corrections(backend, device):
    common = dict(logp=-1.0, old=-1.0, adv=1.0)  # ρ = 1: pg = −A, gradient −A before the weight
    # token_tis: w = min(π_old/π_rollout, C) = min(3, 2) = 2.
    loss, g, met = one_token(
        backend, device, **common, rollout_correction="token_tis", rollout_logprobs=-1 - math.log(3)
    )
    assert (loss, g) == (pytest.approx(-2.0), pytest.approx(-2.0))
    assert float(met.is_weight_mean) == pytest.approx(2.0) and float(met.is_weight_max) == pytest.approx(2.0)
    loss, g, _ = one_token(
        backend, device, **common, rollout_correction="token_tis", rollout_logprobs=-1 - math.log(1.5)
    )
    assert (loss, g) == (pytest.approx(-1.5), pytest.approx(-1.5))
    # token_mis: weight 1 inside [1/C, C], rejected outside.
    loss, g, met = one_token(
        backend, device, **common, rollout_correction="token_mis", rollout_logprobs=-1 - math.log(1.5)
    )
    assert (loss, g) == (pytest.approx(-1.0), pytest.approx(-1.0))
    loss, g, met = one_token(
        backend, device, **common, rollout_correction="token_mis", rollout_logprobs=-1 - math.log(3)
    )
    assert (loss, g) == (0.0, 0.0)
    assert float(met.is_masked_frac) == 1.0
    # decoupled (AReaL): w = π_prox/π_behav, dropped above the cap.
    loss, g, _ = one_token(
        backend, device, **common, rollout_correction="decoupled", rollout_logprobs=-1 - math.log(1.5)
    )
    assert (loss, g) == (pytest.approx(-1.5), pytest.approx(-1.5))
    loss, g, met = one_token(
        backend, device, **common, rollout_correction="decoupled", rollout_logprobs=-1 - math.log(3)
    )
    assert (loss, g) == (0.0, 0.0) and float(met.is_masked_frac) == 1.0


@pytest.mark.parametrize("backend,device", ALL)
def test_sequence_level_corrections(backend, device):
    # Two tokens with log w = ln 1.5 each: sequence weight 2.25.
    lp = torch.full((1, 2), -1.0, dtype=torch.float64, device=device, requires_grad=True)
    old = lp.detach().clone()
    roll = old - math.log(1.5)
    m = torch.ones(1, 2, dtype=torch.bool, device=device)
    a = torch.ones(1, dtype=torch.float64, device=device)
    for kind, C, expect in (
        ("seq_tis", 2.0, -2.0),
        ("seq_tis", 3.0, -2.25),
        ("seq_mis", 2.0, 0.0),
        ("seq_mis", 3.0, -1.0),
    ):
        loss, _ = rk.policy_loss(
            lp, old, a, m, rollout_correction=kind, rollout_threshold=C, rollout_logprobs=roll, backend=backend
        )
        assert float(loss.detach()) == pytest.approx(expect)


def _agg_case(device):
    # Two sequences: 3 valid tokens with per-token loss −A·ρ = −1 (A = 1, ρ = 1), and 1
    # valid token with loss +2 (A = −2); a third, empty sequence.
    lp = torch.zeros(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    m = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool, device=device)
    adv = torch.tensor([1.0, -2.0, 5.0], dtype=torch.float64, device=device)
    return lp, m, adv


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize(
    "agg,kw,expect,g0,g1",
    [
        ("token-mean", {}, (-3 + 2) / 4, -1 / 4, 2 / 4),
        ("token-mean", dict(global_num_tokens=8), (-3 + 2) / 8, -1 / 8, 2 / 8),
        ("token-mean", dict(global_num_tokens=8, dp_size=2), (-3 + 2) / 4, -1 / 4, 2 / 4),
        ("token-sum", {}, -1.0, -1.0, 2.0),
        ("seq-mean-token-sum", {}, (-3 + 2) / 2, -1 / 2, 2 / 2),
        ("seq-mean-token-mean", {}, (-1 + 2) / 2, -1 / 6, 2 / 2),
        ("seq-mean-token-mean", dict(global_num_seqs=torch.tensor(4.0)), (-1 + 2) / 4, -1 / 12, 2 / 4),
        ("seq-mean-token-sum-norm", {}, (-3 + 2) / 2 / 4, -1 / 8, 2 / 8),
        ("seq-mean-token-sum-norm", dict(loss_scale_factor=10.0), (-3 + 2) / 2 / 10, -1 / 20, 2 / 20),
    ],
)
def test_aggregations(backend, device, agg, kw, expect, g0, g1):
    lp, m, adv = _agg_case(device)
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    loss, met = rk.policy_loss(lp, lp.detach(), adv, m, agg=agg, **kw, backend=backend)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(expect)
    g = lp.grad.cpu()
    assert float(g[0, 0]) == pytest.approx(g0) and float(g[1, 1]) == pytest.approx(g1)
    assert float(g[~m.cpu()].abs().sum()) == 0.0
    assert (float(met.num_tokens), float(met.num_seqs)) == (4.0, 2.0)


@pytest.mark.parametrize("backend,device", ALL)
def test_agg_none_returns_per_token_losses(backend, device):
    lp, m, adv = _agg_case(device)
    loss, _ = rk.policy_loss(lp, lp.detach(), adv, m, agg="none", backend=backend)
    expect = torch.tensor([[-1.0, -1, -1, 0], [0, 2, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(loss.detach().cpu(), expect)
    up = torch.arange(12, dtype=torch.float64, device=device).reshape(3, 4)
    loss.backward(up)
    torch.testing.assert_close(lp.grad.cpu(), (-adv[:, None] * up * m).cpu().double())


@pytest.mark.parametrize("backend,device", ALL)
def test_entropy_bonus_gradient(backend, device):
    lp, m, adv = _agg_case(device)
    ent = torch.rand(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    loss, met = rk.policy_loss(lp, lp.detach(), adv, m, entropy=ent, entropy_coef=0.1, backend=backend)
    loss.backward()
    torch.testing.assert_close(ent.grad.cpu(), (-0.1 * m / 4).cpu().double())
    mean_h = float((ent.detach() * m).sum() / 4)
    assert float(loss) == pytest.approx((-3 + 2) / 4 - 0.1 * mean_h)
    assert float(met.entropy_mean) == pytest.approx(mean_h, rel=1e-6)


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(
    "agg", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "none"]
)
def test_all_masked_and_empty_give_zeros(backend, device, layout, agg):
    for B, L in ((3, 5), (0, 5), (2, 0)):
        if layout == "padded":
            lp = torch.randn(B, L, device=device, requires_grad=True)
            m = torch.zeros(B, L, dtype=torch.bool, device=device)
            extra = {}
        else:
            lp = torch.randn(B * L, device=device, requires_grad=True)
            m = torch.zeros(B * L, dtype=torch.bool, device=device)
            extra = dict(cu_seqlens=torch.arange(B + 1, device=device) * L, loss_scale_factor=1.0)
        ent = torch.rand_like(lp, requires_grad=True)
        loss, met = rk.policy_loss(
            lp,
            lp.detach() + 0.3,
            torch.randn(B, device=device),
            m,
            agg=agg,
            kl="k3",
            kl_coef=0.1,
            ref_logprobs=lp.detach(),
            entropy=ent,
            entropy_coef=0.01,
            rollout_correction="seq_tis",
            rollout_logprobs=lp.detach() - 5,
            **extra,
            backend=backend,
        )
        loss.sum().backward()
        assert float(loss.abs().sum()) == 0.0
        assert float(lp.grad.abs().sum()) == 0.0 and float(ent.grad.abs().sum()) == 0.0
        for name, v in met._asdict().items():
            assert torch.isfinite(v).all() and float(v) == 0.0, name


@pytest.mark.parametrize("backend,device", ALL)
def test_zero_tokens_give_zero_not_nan(backend, device):
    """seq-mean-token-sum-norm divides by L by default; with L = 0 there is no token, and the
    loss is 0 with a zero gradient (it was 0/0 = NaN)."""
    lp = torch.zeros(2, 0, device=device, requires_grad=True)
    loss, met = rk.policy_loss(
        lp,
        torch.zeros(2, 0, device=device),
        torch.ones(2, device=device),
        torch.zeros(2, 0, dtype=torch.bool, device=device),
        agg="seq-mean-token-sum-norm",
        backend=backend,
    )
    loss.backward()
    assert float(loss) == 0.0 and float(met.pg_loss) == 0.0
    assert lp.grad is not None and lp.grad.shape == (2, 0)


@pytest.mark.parametrize("backend,device", ALL)
def test_gpg_is_reinforce(backend, device):
    """loss_type="gpg" is reinforce, as a keyword and inside a PolicyLossOptions."""
    assert rk.PolicyLossOptions(loss_type="gpg") == rk.PolicyLossOptions(loss_type="reinforce")
    assert rk.PolicyLossOptions(loss_type="gpg").loss_type == "reinforce"
    gen = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 6, generator=gen) - 1).to(device)
    args = (lp, lp + 0.1, torch.randn(3, generator=gen).to(device), torch.ones(3, 6, dtype=torch.bool, device=device))
    want, _ = rk.policy_loss(*args, loss_type="reinforce", backend=backend)
    for kw in (dict(loss_type="gpg"), dict(options=rk.PolicyLossOptions(loss_type="gpg"))):
        got, _ = rk.policy_loss(*args, **kw, backend=backend)
        assert torch.equal(got, want), kw


@pytest.mark.parametrize("backend,device", ALL)
def test_a3po_rank_selection(backend, device):
    # One positive and one negative sequence; p = exp(old) with a tie.
    p = torch.tensor([[0.1, 0.5, 0.5, 0.9, 0.3, 0.7], [0.2, 0.6, 0.4, 0.8, 0.6, 0.05]], device=device)
    m = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool, device=device)
    adv = torch.tensor([1.0, -1.0], device=device)
    sh = TokenShaping(
        a3po_pos_high=(0.4, 2.0), a3po_pos_low=(0.2, 3.0), a3po_neg_high=(0.34, 0.5), a3po_neg_low=(0.01, 4.0)
    )
    out = rk.shape_token_advantages(adv, p.log(), m, sh, backend=backend).cpu()
    # Row 0: n = 5, pos-high k = 2: 0.9 (t3) and the first 0.5 (t1, lower index wins the tie);
    # pos-low k = 1: 0.1 (t0). Row 1: n = 6, neg-high k = 2: 0.8 (t3), 0.6 (t1, before t4);
    # neg-low k = max(1, 0) = 1: 0.05 (t5).
    expect = torch.tensor([[3.0, 2.0, 1.0, 2.0, 1.0, 0.0], [-1.0, -0.5, -1.0, -0.5, -1.0, -4.0]])
    torch.testing.assert_close(out, expect)


@pytest.mark.parametrize("backend,device", ALL)
def test_entropy_quantile_mask(backend, device):
    # 10 valid tokens with entropies 0..9: the 0.8 quantile is 7.2, so tokens 8 and 9 keep
    # their policy-gradient term (TRL's 80/20 rule, torch.quantile interpolation).
    ent = torch.arange(12, dtype=torch.float32, device=device).reshape(1, 12)
    m = torch.ones(1, 12, dtype=torch.bool, device=device)
    m[0, 10:] = False
    adv = torch.ones(1, device=device)
    out = rk.shape_token_advantages(
        adv, torch.zeros(1, 12, device=device), m, TokenShaping(entropy_quantile=0.2), entropy=ent, backend=backend
    )
    assert out.cpu().flatten().tolist() == [0.0] * 8 + [1.0, 1.0, 0.0, 0.0]
    lp = torch.zeros(1, 12, device=device, requires_grad=True)
    loss, met = rk.policy_loss(
        lp, lp.detach(), adv, m, shaping=TokenShaping(entropy_quantile=0.2), entropy=ent, backend=backend
    )
    assert float(loss) == pytest.approx(-2 / 10)
    assert float(met.shaped_frac) == pytest.approx(0.8)


@pytest.mark.parametrize("backend,device", ALL)
def test_clip_sides_and_sequence_extrema(backend, device):
    """The per-side clip fractions and the per-sequence extrema of the clip sides (ppo,
    ε = 0.2): sequence 0 (A > 0) has ratios 1.5, 1.0, 1.3 (high on 2 of 3), sequence 1
    (A < 0) has 0.5, 1.0 (low on 1 of 2), sequence 2 is empty (left out of the extrema)."""
    ratio = torch.tensor([[1.5, 1.0, 1.3], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    old = torch.full((3, 3), -1.0, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    _, m = rk.policy_loss(
        (old + ratio.log()).to(device), old.to(device), adv.to(device), mask.to(device), backend=backend
    )
    assert float(m.pg_clipfrac_high) == pytest.approx(2 / 5) and float(m.pg_clipfrac_low) == pytest.approx(1 / 5)
    assert float(m.pg_clipfrac) == pytest.approx(3 / 5)  # the union, unchanged
    assert float(m.seq_clipfrac_high_mean) == pytest.approx((2 / 3 + 0) / 2)
    assert float(m.seq_clipfrac_low_mean) == pytest.approx((0 + 1 / 2) / 2)
    assert float(m.seq_clipfrac_low_min) == pytest.approx(0.0)
    assert float(m.seq_clipfrac_high_max) == pytest.approx(2 / 3)
    # cispo: the sides at its own range (high: ρ > 1 + clip_high with A > 0)
    _, m = rk.policy_loss(
        (old + ratio.log()).to(device),
        old.to(device),
        adv.to(device),
        mask.to(device),
        loss_type="cispo",
        clip_high=0.4,
        backend=backend,
    )
    assert float(m.pg_clipfrac_high) == pytest.approx(1 / 5) and float(m.seq_clipfrac_high_max) == pytest.approx(1 / 3)
    # GSPO: every token of a sequence shares its ratio s_i (here exp(mean log ρ) of sequence 0 ≈ 1.24)
    _, m = rk.policy_loss(
        (old + ratio.log()).to(device),
        old.to(device),
        adv.to(device),
        mask.to(device),
        loss_type="gspo",
        backend=backend,
    )
    assert float(m.seq_clipfrac_high_max) == 1.0 and float(m.seq_clipfrac_low_min) == 0.0
    assert float(m.pg_clipfrac_high) == pytest.approx(3 / 5) and float(m.pg_clipfrac_low) == pytest.approx(2 / 5)
    # no valid token: zeros, never NaN
    _, m = rk.policy_loss(
        old.to(device), old.to(device), adv.to(device), torch.zeros_like(mask).to(device), backend=backend
    )
    for name in ("pg_clipfrac_low", "pg_clipfrac_high", "seq_clipfrac_low_min", "seq_clipfrac_high_max"):
        assert float(getattr(m, name)) == 0.0, name


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "reinforce"])
def test_kl_ratio_correction(backend, device, loss_type):
    """kl_ratio_correction: the KL term times the ratio r (exp δ; GSPO's token-form s_i),
    value and gradient; kl / kl_loss report the corrected term."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, device=device, requires_grad=True)
    old = torch.tensor([[-1.2, -1.7]], dtype=torch.float64, device=device)
    ref = torch.tensor([[-0.5, -2.5]], dtype=torch.float64, device=device)
    m = torch.ones(1, 2, dtype=torch.bool, device=device)
    adv = torch.zeros(1, dtype=torch.float64, device=device)
    kw = dict(loss_type=loss_type, kl="k3", kl_coef=0.5, agg="token-sum", ref_logprobs=ref, backend=backend)
    loss, met = rk.policy_loss(lp, old, adv, m, kl_ratio_correction=True, **kw)
    loss.backward()
    x = lp.detach().clone().requires_grad_(True)
    y = ref - x
    k3 = torch.exp(y) - y - 1
    if loss_type == "gspo":
        r = torch.exp(x - x.detach() + (x.detach() - old).mean())
    else:
        r = torch.exp(x - old)
    want = 0.5 * (k3 * r).sum()
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    torch.testing.assert_close(lp.grad, x.grad, rtol=1e-12, atol=1e-12)
    assert float(met.kl) == pytest.approx(float((k3 * r).detach().mean()), rel=1e-6)


@pytest.mark.parametrize("backend,device", ALL)
def test_gspo_dual_clip(backend, device):
    """gspo_dual_clip: ppo's dual clip on GSPO's sequence ratio (A < 0: min(·, −A·c));
    without it clip_ratio_c leaves GSPO alone (verl's GSPO)."""
    old = torch.full((1, 2), -1.0, dtype=torch.float64, device=device)
    adv = torch.tensor([-1.0], dtype=torch.float64, device=device)
    m = torch.ones(1, 2, dtype=torch.bool, device=device)
    for dual, want_loss, want_grad in ((True, 3.0, 0.0), (False, 4.0, 2.0)):
        lp = (old + math.log(4.0)).requires_grad_(True)  # s = 4 > c = 3
        opts = rk.PolicyLossOptions(loss_type="gspo", clip_ratio_c=3.0, gspo_dual_clip=dual, agg="token-mean")
        loss, met = rk.policy_loss(lp, old, adv, m, options=opts, backend=backend)
        loss.backward()
        assert float(loss.detach()) == pytest.approx(want_loss)
        assert float(lp.grad[0, 0]) == pytest.approx(want_grad)
        assert float(met.pg_clipfrac_lower) == (1.0 if dual else 0.0)


@pytest.mark.parametrize("backend,device", ALL)
def test_entropy_threshold_argument(backend, device):
    """entropy_threshold= replaces the call's own quantile: tokens with entropy >= it keep
    their pg term (e.g. a threshold computed over every data-parallel rank)."""
    lp = torch.zeros(1, 4, dtype=torch.float64, device=device, requires_grad=True)
    ent = torch.tensor([[0.1, 0.5, 0.9, 1.3]], dtype=torch.float64, device=device)
    m = torch.ones(1, 4, dtype=torch.bool, device=device)
    adv = torch.ones(1, dtype=torch.float64, device=device)
    shaping = TokenShaping(entropy_quantile=0.5)
    thr = torch.tensor(0.7, device=device)
    loss, _ = rk.policy_loss(
        lp,
        lp.detach(),
        adv,
        m,
        loss_type="reinforce",
        agg="token-sum",
        shaping=shaping,
        entropy=ent,
        entropy_threshold=thr,
        backend=backend,
    )
    loss.backward()
    assert lp.grad.cpu().tolist() == [[0.0, 0.0, -1.0, -1.0]]
    with pytest.raises(ValueError, match="entropy_threshold"):
        rk.policy_loss(lp, lp.detach(), adv, m, entropy_threshold=thr, backend=backend)


@pytest.mark.parametrize("backend,device", ALL)
def test_geo_mean_values(backend, device):
    """One sequence of two tokens: r = exp(mean δ_min), L = −Ā·r on agg=seq-mean-token-sum;
    a clipped token (A > 0, δ > ε_high) carries no gradient, the other L/n; the clip
    metrics split by the sign of A."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, device=device, requires_grad=True)
    old = torch.tensor([[-1.5, -2.1]], dtype=torch.float64, device=device)  # δ = 0.5, 0.1
    adv = torch.tensor([[2.0, 1.0]], dtype=torch.float64, device=device)
    m = torch.ones(1, 2, dtype=torch.bool, device=device)
    o = rk.PolicyLossOptions(loss_type="geo_mean", clip_low=0.2, clip_high=0.3, agg="seq-mean-token-sum")
    loss, met = rk.policy_loss(lp, old, adv, m, options=o, backend=backend)
    loss.backward()
    r = math.exp((0.3 + 0.1) / 2)
    assert float(loss.detach()) == pytest.approx(-1.5 * r)
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -1.5 * r / 2])
    assert (float(met.pg_clipfrac), float(met.pg_clipfrac_lower)) == (0.5, 0.0)
    # A < 0: δ below −ε_low is clipped, above ε_high is not
    loss, met = rk.policy_loss(lp.detach(), old + 0.7, -adv, m, options=o, backend=backend)  # δ = −0.2, −0.6
    assert float(loss) == pytest.approx(1.5 * math.exp((-0.2 - 0.2) / 2))
    assert (float(met.pg_clipfrac), float(met.pg_clipfrac_lower)) == (0.0, 0.5)


@pytest.mark.parametrize("backend,device", ALL)
def test_dro_values(backend, device):
    """−(A·logp − ½β·δ²) and its derivative −A + β·δ."""
    loss, grad, met = one_token(
        backend, device, logp=-1.0, old=-1.5, adv=2.0, options=rk.PolicyLossOptions(loss_type="dro", dro_beta=0.4)
    )
    assert (loss, grad) == (pytest.approx(2.0 + 0.5 * 0.4 * 0.25), pytest.approx(-2.0 + 0.4 * 0.5))
    assert float(met.ppo_kl) == pytest.approx(-0.5)


@pytest.mark.parametrize("backend,device", ALL)
def test_geo_mean_dro_empty_and_all_masked(backend, device):
    for lt in ("geo_mean", "dro"):
        o = rk.PolicyLossOptions(loss_type=lt, dro_beta=0.1 if lt == "dro" else None, agg="seq-mean-token-sum")
        for B, L in ((3, 5), (0, 5)):
            lp = torch.randn(B, L, device=device).requires_grad_(True)
            loss, met = rk.policy_loss(
                lp,
                lp.detach(),
                torch.randn(B, device=device),
                torch.zeros(B, L, dtype=torch.bool, device=device),
                options=o,
                backend=backend,
            )
            loss.backward()
            assert float(loss) == 0.0 and float(lp.grad.abs().sum()) == 0.0
            assert float(met.ppo_kl) == 0.0 and float(met.pg_clipfrac) == 0.0


def test_geo_mean_dro_options_checked():
    with pytest.raises(ValueError, match="dro_beta"):
        rk.PolicyLossOptions(loss_type="dro")
    with pytest.raises(ValueError, match="dro_beta"):
        rk.PolicyLossOptions(loss_type="dro", dro_beta=-1.0)
    with pytest.raises(ValueError, match="rollout_correction"):
        rk.PolicyLossOptions(loss_type="geo_mean", rollout_correction="token_tis")
    rk.PolicyLossOptions(loss_type="geo_mean", rollout_correction="seq_tis", clip_low=2.0)
