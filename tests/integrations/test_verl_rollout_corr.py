"""rlvr_kernels.integrations.verl.rollout_corr_helper and compute_policy_loss_bypass_mode
against verl 0.9.1's functions on the same inputs (values, masks, metrics, gradients), on
the reference and the cpu backend; and the op layer's rollout_correction token outputs."""

import math

import pytest
import torch
import verl.trainer.ppo.core_algos as verl_core
import verl.trainer.ppo.rollout_corr_helper as verl_rch
from _rollout_chains import RS_CHAINS
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.workers.config import FSDPActorConfig
from verl.workers.config.actor import PolicyLossConfig

import rlvr_kernels as rk
from rlvr_kernels import RolloutCorrection
from rlvr_kernels.integrations._backend import use_backend
from rlvr_kernels.integrations.verl import core_algos as ours_core
from rlvr_kernels.integrations.verl import rollout_corr_helper as ours

BACKENDS = ["reference", "cpu"]


def _case(seed, B=6, L=9, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, L, generator=g) * 2
    roll = old + spread * torch.randn(B, L, generator=g)
    mask = (torch.rand(B, L, generator=g) > 0.2).float()
    mask[:, 0] = 1
    mask[-1] = 0  # a sequence without a valid token
    mask[-1, :0] = 1
    return old, roll, mask


def _same_metrics(a, b, tol=1e-5):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        x, y = a[k], b[k]
        assert isinstance(x, float), (k, type(x))
        assert abs(x - y) <= tol * max(1.0, abs(y)), (k, x, y)
        assert math.isfinite(x), k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("thr", [2.0, 1.1, "0.5_2.0", "0.7_1.5"])
@pytest.mark.parametrize("norm", [False, True])
def test_weights_match_verl(backend, level, thr, norm):
    old, roll, mask = _case(3)
    w0, m0 = verl_rch.compute_rollout_correction_weights(old - roll, mask, level, thr, norm)
    with use_backend(backend):
        w1, m1 = ours.compute_rollout_correction_weights(old - roll, mask, level, thr, norm)
    assert w1.dtype == w0.dtype and not w1.requires_grad
    torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)
    _same_metrics(m1, m0)


# One threshold shared by a chain: verl applies it to every criterion.
CHAINS = [*RS_CHAINS, ("seq_mean_k1,token_k3", 1.2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rs,thr", CHAINS)
def test_rejection_matches_verl(backend, rs, thr):
    old, roll, mask = _case(sum(map(ord, rs)) % 1000)
    for m in (mask, mask.bool()):
        k0, m0 = verl_rch.compute_rollout_rejection_mask(old - roll, m, rs, thr)
        with use_backend(backend):
            k1, m1 = ours.compute_rollout_rejection_mask(old - roll, m, rs, thr)
        assert k1.dtype == k0.dtype
        torch.testing.assert_close(k1, k0)
        _same_metrics(m1, m0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "is_args,rs_args",
    [
        ((None, 2.0, False), (None, None)),
        (("token", 2.0, False), (None, None)),
        (("sequence", "0.5_3.0", True), ("seq_mean_k1,token_k3", "0.8_1.25,0.3")),
        (("token", 1.5, True), ("token_k2,seq_max_k3", "0.1,0.4")),
        ((None, 2.0, False), ("seq_sum_k2", 0.4)),
        (("sequence", None, False), ("token_k1", "2.0")),  # a None threshold: no IS (verl)
    ],
)
def test_combined_matches_verl(backend, is_args, rs_args):
    old, roll, mask = _case(11)
    args = (old, roll, mask) + is_args + rs_args
    p0, k0, m0 = verl_rch.compute_rollout_correction_and_rejection_mask(*args)
    with use_backend(backend):
        p1, k1, m1 = ours.compute_rollout_correction_and_rejection_mask(*args)
    assert (p0 is None) == (p1 is None)
    if p0 is not None:
        torch.testing.assert_close(p1.batch["rollout_is_weights"], p0.batch["rollout_is_weights"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k1, k0)
    _same_metrics(m1, m0)
    assert all(k.startswith("rollout_corr/") for k in m1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rejected_batch(backend):
    old, roll, mask = _case(5, spread=3.0)
    args = (old, roll, mask, "sequence", 2.0, True, "token_k2", 1e-6)
    p0, k0, m0 = verl_rch.compute_rollout_correction_and_rejection_mask(*args)
    with use_backend(backend):
        p1, k1, m1 = ours.compute_rollout_correction_and_rejection_mask(*args)
    assert float(k1.sum()) == 0
    torch.testing.assert_close(k1, k0)
    torch.testing.assert_close(p1.batch["rollout_is_weights"], p0.batch["rollout_is_weights"], rtol=1e-5, atol=1e-6)
    _same_metrics(m1, m0)
    assert m1["rollout_corr/rollout_rs_masked_fraction"] == 1.0


def test_offpolicy_metrics_and_errors():
    old, roll, mask = _case(2)
    _same_metrics(ours.compute_offpolicy_metrics(old, roll, mask), verl_rch.compute_offpolicy_metrics(old, roll, mask))
    _same_metrics(ours.compute_offpolicy_metrics(old, None, mask), verl_rch.compute_offpolicy_metrics(old, None, mask))
    _same_metrics(
        ours.compute_rollout_corr_metrics_from_logprobs(old, roll, mask),
        verl_rch.compute_rollout_corr_metrics_from_logprobs(old, roll, mask),
    )
    with pytest.raises(ValueError, match="at least one valid token"):
        ours.compute_rollout_correction_and_rejection_mask(old, roll, torch.zeros_like(mask), "token")
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        ours.compute_rollout_rejection_mask(old - roll, mask, "token_k1", None)
    with pytest.raises(ValueError, match="token_k9"):
        ours.compute_rollout_rejection_mask(old - roll, mask, "token_k9", 2.0)
    with pytest.raises(ValueError, match="rollout_is"):
        ours.compute_rollout_correction_weights(old - roll, mask, "tok")
    with pytest.raises(ValueError, match="does not match"):
        ours.compute_rollout_correction_and_rejection_mask(old, roll[:, :3], mask)


# ------------------------------------------------------------------ the op layer's token outputs
@pytest.mark.parametrize("packed", [False, True])
def test_op_token_outputs_cpu_vs_reference(packed):
    g = torch.Generator().manual_seed(1)
    B, L = 5, 7
    old = -torch.rand(B, L, generator=g, dtype=torch.float64)
    roll = old + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    lp = old + 0.1 * torch.randn(B, L, generator=g, dtype=torch.float64)
    mask = torch.rand(B, L, generator=g) > 0.25
    rc = RolloutCorrection(
        is_level="sequence",
        is_batch_normalize=True,
        rs="token_k1,seq_max_k2",
        rs_threshold="0.7_1.4,0.2",
        log_ratio="current",
    )
    kw = {}
    args = (old, roll, mask)
    if packed:
        lens = mask.sum(-1)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        args = (old[mask], roll[mask], None)
        kw = dict(cu_seqlens=cu, logprobs=lp[mask])
    else:
        kw = dict(logprobs=lp)
    ref = rk.rollout_correction(rc, *args, backend="reference", **kw)
    cpu = rk.rollout_correction(rc, *args, backend="cpu", **kw)
    for a, b in zip(cpu[:2], ref[:2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert float(ref[1].sum()) < float((mask if not packed else torch.ones(int(mask.sum()))).sum())  # some rejected
    assert float(ref[0].abs().sum()) > 0
    for name in ("rs_masked_frac", "rs_seq_masked_frac", "is_batch_norm_factor", "num_tokens", "is_weight_mean"):
        torch.testing.assert_close(getattr(cpu[2], name), getattr(ref[2], name))


def test_op_validation():
    x = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="correction"):
        rk.rollout_correction("token", x, x, x > -1)
    with pytest.raises(ValueError, match="correction"):
        rk.rollout_correction(RolloutCorrection(), x, x, x > -1)
    with pytest.raises(ValueError, match="logprobs"):
        rk.rollout_correction(RolloutCorrection(is_level="token", log_ratio="current"), x, x, x > -1)


# ------------------------------------------------------------------ bypass mode
def _bypass_config(loss_type, **rc):
    rcc = RolloutCorrectionConfig(loss_type=loss_type, **rc)
    return FSDPActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=2,
        ppo_mini_batch_size=6,
        rollout_n=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rcc),
    )


BYPASS_RC = [
    dict(
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k1,token_k3",
        rollout_rs_threshold="0.8_1.25,0.3",
    ),
    dict(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),
    dict(rollout_is=None, rollout_rs="seq_max_k2", rollout_rs_threshold=0.2),
    dict(rollout_is=None),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("rc", BYPASS_RC)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_bypass_mode_matches_verl(backend, loss_type, rc, agg):
    g = torch.Generator().manual_seed(4)
    B, L = 6, 9
    roll = -torch.rand(B, L, generator=g) * 2
    lp = roll + 0.3 * torch.randn(B, L, generator=g)
    mask = torch.rand(B, L, generator=g) > 0.2
    mask[:, 0] = True
    adv = torch.randn(B, L, generator=g)
    cfg = _bypass_config(loss_type, **rc)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    l0, m0 = verl_core.compute_policy_loss_bypass_mode(roll, a, adv, mask, agg, cfg)
    with use_backend(backend):
        l1, m1 = ours_core.compute_policy_loss_bypass_mode(roll, b, adv, mask, agg, cfg)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    l0.backward()
    l1.backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    _same_metrics(m1, m0)


def test_bypass_mode_errors():
    x = torch.zeros(2, 3)
    cfg = _bypass_config("ppo")
    with pytest.raises(ValueError, match="loss_type"):
        ours_core.compute_policy_loss_bypass_mode(x, x, x, x > -1, "token-mean", cfg)
