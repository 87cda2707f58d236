"""RolloutCorrection (docs/policy-loss.md, "Rollout correction") against verl 0.9.1's
rollout_corr_helper on the same inputs, on the reference and the cpu backend."""

import math

import pytest
import torch
import verl.trainer.ppo.rollout_corr_helper as rc_helper
from _rollout_chains import RS_CHAINS

from rlvr_kernels import PolicyLossOptions, RolloutCorrection, policy_loss


def _case(seed, B=6, L=9):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, L, generator=g, dtype=torch.float64) * 2
    old = lp + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    roll = old + 0.4 * torch.randn(B, L, generator=g, dtype=torch.float64)
    mask = torch.rand(B, L, generator=g) > 0.2
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return lp, old, roll, mask, adv


def _verl_loss(lp, old, adv, mask, is_w):
    # token-mean PPO (verl's compute_policy_loss_vanilla body, dual clip 3, no δ clamp issue)
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    a = adv[:, None].expand_as(lp)
    l1, l2 = -a * ratio, -a * torch.clamp(ratio, 0.8, 1.2)
    pg = torch.maximum(l1, l2)
    pg = torch.where(a < 0, torch.minimum(-a * 3.0, pg), pg)
    if is_w is not None:
        pg = pg * is_w
    m = mask.double()
    return (pg * m).sum() / m.sum()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("rs,thr", RS_CHAINS)
def test_rejection_matches_verl(rs, thr, backend):
    lp, old, roll, mask, adv = _case(sum(map(ord, rs)) % 1000)
    dtype = torch.float64 if backend == "reference" else torch.float32
    lp, old, roll, adv = (t.to(dtype) for t in (lp, old, roll, adv))
    keep, metrics = rc_helper.compute_rollout_rejection_mask(old - roll, mask.to(dtype), rs, thr)
    rc = RolloutCorrection(rs=rs, rs_threshold=thr)
    opts = PolicyLossOptions(clip_ratio_c=3.0, rollout_correction=rc)
    lpg = lp.clone().requires_grad_(True)
    loss, m = policy_loss(lpg, old, adv, mask, options=opts, rollout_logprobs=roll, backend=backend)
    lpv = lp.clone().requires_grad_(True)
    ref = _verl_loss(lpv, old, adv, keep.bool(), None) if keep.sum() > 0 else lpv.sum() * 0
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss.double(), ref.double(), **tol)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(lpg.grad.double(), lpv.grad.double(), **tol)
    assert float(m.num_tokens) == float(keep.sum())
    torch.testing.assert_close(float(m.rs_masked_frac), metrics["rollout_rs_masked_fraction"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        float(m.rs_seq_masked_frac), metrics["rollout_rs_seq_masked_fraction"], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("thr", [2.0, "0.5_2.0"])
@pytest.mark.parametrize("norm", [False, True])
def test_is_weights_match_verl(level, thr, norm, backend):
    lp, old, roll, mask, adv = _case(7)
    roll = old + 0.05 * (roll - old)  # sequence weights inside the bounds for some rows
    dtype = torch.float64 if backend == "reference" else torch.float32
    lp, old, roll, adv = (t.to(dtype) for t in (lp, old, roll, adv))
    w, metrics = rc_helper.compute_rollout_correction_weights(old - roll, mask.to(dtype), level, thr, norm)
    rc = RolloutCorrection.from_verl(level, thr, norm)
    opts = PolicyLossOptions(clip_ratio_c=3.0, rollout_correction=rc)
    lpg = lp.clone().requires_grad_(True)
    loss, m = policy_loss(lpg, old, adv, mask, options=opts, rollout_logprobs=roll, backend=backend)
    lpv = lp.clone().requires_grad_(True)
    ref = _verl_loss(lpv, old, adv, mask, w)
    tol = dict(rtol=2e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(loss.double(), ref.double(), **tol)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(lpg.grad.double(), lpv.grad.double(), **tol)
    if norm:
        torch.testing.assert_close(float(m.is_batch_norm_factor), metrics["rollout_is_batch_norm_factor"], **tol)


def test_geo_mean_is_seq_mean_k1():
    lp, old, roll, mask, adv = _case(3)
    a = RolloutCorrection(geo_mean=(0.8, 1.25))
    b = RolloutCorrection(rs="seq_mean_k1", rs_threshold="0.8_1.25")
    for backend in ("reference", "cpu"):
        x = [
            policy_loss(
                lp,
                old,
                adv,
                mask,
                options=PolicyLossOptions(rollout_correction=r),
                rollout_logprobs=roll,
                backend=backend,
            )[0]
            for r in (a, b)
        ]
        torch.testing.assert_close(x[0], x[1])


def test_all_rejected_gives_zeros():
    lp, old, roll, mask, adv = _case(5)
    rc = RolloutCorrection(rs="token_k2", rs_threshold=1e-12)
    for backend in ("reference", "cpu"):
        lpg = lp.float().clone().requires_grad_(True)
        loss, m = policy_loss(
            lpg,
            old.float(),
            adv.float(),
            mask,
            options=PolicyLossOptions(rollout_correction=rc),
            rollout_logprobs=roll.float(),
            backend=backend,
        )
        loss.backward()
        assert float(loss) == 0.0 and torch.isfinite(lpg.grad).all() and float(lpg.grad.abs().sum()) == 0.0
        assert float(m.rs_masked_frac) == 1.0 and float(m.num_tokens) == 0.0


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="rollout_correction.rs"):
        RolloutCorrection(rs="token_k4", rs_threshold=1.0)
    with pytest.raises(ValueError, match="rollout_correction.rs_threshold"):
        RolloutCorrection(rs="token_k2", rs_threshold="0.1_2")
    with pytest.raises(ValueError, match="rollout_correction.is_threshold_low"):
        RolloutCorrection(is_level="token", is_mode="icepop")
    with pytest.raises(TypeError, match="rollout_correction"):
        PolicyLossOptions(rollout_correction=3)


def test_shorthands_unchanged():
    lp, old, roll, mask, adv = _case(11)
    for name in ("token_tis", "seq_tis", "token_mis", "seq_mis", "decoupled"):
        level, mode = {
            "token_tis": ("token", "truncate"),
            "seq_tis": ("sequence", "truncate"),
            "token_mis": ("token", "mask"),
            "seq_mis": ("sequence", "mask"),
            "decoupled": ("token", "decoupled"),
        }[name]
        for backend in ("reference", "cpu"):
            a = policy_loss(
                lp.float(),
                old.float(),
                adv.float(),
                mask,
                rollout_correction=name,
                rollout_logprobs=roll.float(),
                backend=backend,
            )[0]
            b = policy_loss(
                lp.float(),
                old.float(),
                adv.float(),
                mask,
                options=PolicyLossOptions(rollout_correction=RolloutCorrection(level, 2.0, None, mode)),
                rollout_logprobs=roll.float(),
                backend=backend,
            )[0]
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_nemo_rl_seq_mask_tis_hand_computed(backend):
    """NeMo-RL's seq-mask-tis (docs/presets.md): a sequence is gated on exp(mean of x over
    its valid tokens), x = old − rollout; the kept ones keep their raw token weights exp(x);
    the gated ones keep their tokens in the token-mean's count. π = π_old (ratio 1).
    seq 0: x = (ln 3, 0), A = 1: geo-mean √3 in [0.5, 2] (its sum, 3, would gate it).
    seq 1: x = (ln 1.5, −ln 1.5), A = −2: geo-mean 1.
    seq 2: x = (ln 3, padding 0), A = 3: geo-mean 3 over its one valid token (√3 over L).
    loss = (−(3 + 1) + 2·(1.5 + 2/3) + 0) / 5 = 1/15; ∂/∂logπ = −A·w/5 on the kept tokens."""
    x = torch.tensor([[math.log(3), 0.0], [math.log(1.5), -math.log(1.5)], [math.log(3), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    old = torch.full((3, 2), -1.0, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    dtype = torch.float64 if backend == "reference" else torch.float32
    lp = old.clone().to(dtype).requires_grad_(True)
    rc = RolloutCorrection(is_level="sequence", is_mode="gate", is_threshold=2.0, is_threshold_low=0.5)
    loss, m = policy_loss(
        lp,
        old.to(dtype),
        adv.to(dtype),
        mask,
        preset="nemo_rl",
        rollout_correction=rc,
        rollout_logprobs=(old - x).to(dtype),
        backend=backend,
    )
    loss.backward()
    tol = dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss.double(), torch.tensor(1 / 15, dtype=torch.float64), **tol)
    grad = torch.tensor([[-3 / 5, -1 / 5], [3 / 5, 4 / 15], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad.double(), grad, **tol)
    # NeMo-RL's sampling_importance_ratio (the gated weights' token mean) is is_weight_mean;
    # its is_oob_ratio counts the gated sequences (1/3), is_masked_frac the gated tokens.
    torch.testing.assert_close(float(m.is_weight_mean), 37 / 30, **tol)
    torch.testing.assert_close(float(m.is_masked_frac), 1 / 5, **tol)
    assert float(m.num_tokens) == 5.0
