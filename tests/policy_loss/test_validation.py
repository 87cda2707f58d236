"""Bad input to policy_loss / shape_token_advantages: a clear ValueError/TypeError naming
the argument, raised before any kernel runs."""

import pytest
import torch
from _backends import ALL

import rlvr_kernels as rk
from rlvr_kernels import PolicyLossOptions, TokenShaping


def base(B=3, L=5):
    lp = torch.randn(B, L) - 1
    return dict(logprobs=lp, old_logprobs=lp + 0.1, advantages=torch.randn(B), mask=torch.ones(B, L, dtype=torch.bool))


def call(**over):
    kw = base()
    kw.update(over)
    return rk.policy_loss(**kw)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(logprobs=[1.0]), TypeError, "logprobs: expected a torch.Tensor"),
        (dict(logprobs=torch.zeros(3, 5, dtype=torch.long)), TypeError, "logprobs: expected dtype"),
        (dict(logprobs=torch.zeros(3, 5, 2)), ValueError, "logprobs: expected a 1-D or 2-D"),
        (dict(old_logprobs=torch.zeros(3, 4)), ValueError, r"old_logprobs: expected shape \(3, 5\)"),
        (dict(old_logprobs=torch.zeros(3, 5, dtype=torch.int32)), TypeError, "old_logprobs: expected dtype"),
        (dict(advantages=torch.zeros(4)), ValueError, r"advantages: expected \[B=3\]"),
        (dict(advantages=torch.zeros(3, dtype=torch.long)), TypeError, "advantages: expected dtype"),
        (dict(mask=None), ValueError, "mask: the padded"),
        (dict(mask=torch.ones(3, 4)), ValueError, r"mask: expected shape \(3, 5\)"),
        (dict(mask=torch.ones(3, 5, dtype=torch.complex64)), TypeError, "mask: expected dtype"),
        (dict(kl="k3", kl_coef=0.1), ValueError, "ref_logprobs: kl='k3' needs"),
        (dict(kl="k4"), ValueError, "kl: expected one of"),
        (dict(rollout_correction="token_tis"), ValueError, "rollout_logprobs: rollout_correction='token_tis' needs"),
        (dict(rollout_correction="icepop"), ValueError, "rollout_correction: expected one of"),
        (dict(entropy_coef=0.01), ValueError, "entropy: entropy_coef != 0 needs"),
        (dict(kl_ratio_correction=1), TypeError, "kl_ratio_correction: expected a bool"),
        (dict(gspo_dual_clip="yes"), TypeError, "gspo_dual_clip: expected a bool"),
        (dict(entropy_threshold=torch.tensor(0.5)), ValueError, "entropy_threshold: only used with"),
        (
            dict(
                shaping=TokenShaping(entropy_quantile=0.2),
                entropy=torch.rand(3, 5),
                entropy_threshold=torch.zeros(2),
            ),
            ValueError,
            "entropy_threshold: expected one element",
        ),
        (
            dict(shaping=TokenShaping(entropy_quantile=0.2), entropy=torch.rand(3, 5), entropy_threshold=[0.5]),
            TypeError,
            "entropy_threshold: expected a torch.Tensor",
        ),
        (dict(shaping=TokenShaping(entropy_quantile=0.2)), ValueError, "entropy: shaping.entropy_quantile needs"),
        (dict(loss_type="ppo2"), ValueError, "loss_type: expected one of"),
        (dict(clip_low=1.5), ValueError, "clip_low: expected a value <= 1.0"),
        (dict(clip_low=-0.1), ValueError, "clip_low: expected a value >= 0.0"),
        (dict(clip_high=float("nan")), ValueError, "clip_high: expected a finite float"),
        (dict(clip_ratio_c=1.0), ValueError, "clip_ratio_c: the dual-clip bound must be > 1"),
        (dict(rollout_threshold=0.0), ValueError, "rollout_threshold: expected a value > 0.0"),
        (dict(agg="mean"), ValueError, "agg: expected one of"),
        (dict(preset="openrlhf-v0"), ValueError, "preset: expected one of"),
        (dict(dp_size=0), ValueError, "dp_size: expected an int >= 1"),
        (dict(global_num_tokens=-1), ValueError, "global_num_tokens: expected a finite count >= 0"),
        (dict(global_num_seqs=torch.ones(2)), ValueError, "global_num_seqs: expected a number or a 1-element tensor"),
        (dict(loss_scale_factor=0.0), ValueError, "loss_scale_factor: expected a finite number > 0"),
        (dict(options=PolicyLossOptions(), kl="k1"), ValueError, "options: give either"),
        (dict(options={"loss_type": "ppo"}), TypeError, "options: expected a rlvr_kernels.PolicyLossOptions"),
        (dict(shaping={"w_pos": 0.1}), TypeError, "shaping: expected a rlvr_kernels.TokenShaping"),
        (dict(backend="cuda"), ValueError, "backend: expected one of"),
    ],
)
def test_bad_arguments(over, exc, match):
    with pytest.raises(exc, match=match):
        call(**over)


@pytest.mark.parametrize("backend,device", ALL)
def test_non_finite_inputs_on_valid_tokens(backend, device):
    def run(kw, **extra):
        kw = {k: v.to(device) for k, v in kw.items()}
        return rk.policy_loss(**kw, **extra, backend=backend)

    kw = base()
    kw["logprobs"][1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"logprobs: non-finite value nan at \(1, 2\)"):
        run(kw)
    kw = base()
    kw["old_logprobs"][0, 0] = -float("inf")
    with pytest.raises(ValueError, match="old_logprobs: non-finite"):
        run(kw)
    kw = base()
    kw["advantages"][1] = float("inf")
    with pytest.raises(ValueError, match="advantages: non-finite"):
        run(kw)
    kw = base()
    ref = kw["logprobs"].clone()
    ref[2, 3] = float("nan")
    with pytest.raises(ValueError, match="ref_logprobs: non-finite"):
        run(dict(kw, ref_logprobs=ref), kl="k3", kl_coef=0.1)
    with pytest.raises(ValueError, match="rollout_logprobs: non-finite"):
        run(dict(kw, rollout_logprobs=ref), rollout_correction="seq_tis")
    # Padding may hold anything: -inf on a masked token is fine.
    kw = base()
    kw["mask"][2, 4] = False
    kw["logprobs"][2, 4] = -float("inf")
    loss, _ = run(kw)
    assert torch.isfinite(loss)
    # validate=False skips the value checks (the kernels stay bounds-safe).
    kw["logprobs"][0, 0] = float("nan")
    run(kw, validate=False)


def test_packed_layout_errors():
    lp = torch.randn(10)
    adv = torch.randn(3)
    cu = torch.tensor([0, 4, 6, 10])
    with pytest.raises(ValueError, match="logprobs: a 1-D"):
        rk.policy_loss(lp, lp, adv)
    with pytest.raises(ValueError, match="logprobs: with cu_seqlens expected a packed 1-D"):
        rk.policy_loss(lp.reshape(2, 5), lp.reshape(2, 5), torch.randn(2), torch.ones(2, 5), cu_seqlens=cu)
    with pytest.raises(TypeError, match="cu_seqlens: expected dtype"):
        rk.policy_loss(lp, lp, adv, cu_seqlens=cu.float())
    with pytest.raises(ValueError, match=r"cu_seqlens: expected cu_seqlens\[0\] == 0"):
        rk.policy_loss(lp, lp, adv, cu_seqlens=torch.tensor([1, 4, 6, 10]))
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing"):
        rk.policy_loss(lp, lp, adv, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match=r"cu_seqlens: expected cu_seqlens\[-1\] <= T = 10"):
        rk.policy_loss(lp, lp, adv, cu_seqlens=torch.tensor([0, 4, 6, 11]))
    with pytest.raises(ValueError, match=r"advantages: expected \[B=3\]"):
        rk.policy_loss(lp, lp, torch.randn(4), cu_seqlens=cu)
    with pytest.raises(ValueError, match="loss_scale_factor: agg='seq-mean-token-sum-norm' on the packed"):
        rk.policy_loss(lp, lp, adv, cu_seqlens=cu, agg="seq-mean-token-sum-norm")


def test_shaping_options_are_checked():
    with pytest.raises(ValueError, match="shaping.probability: expected a value <= 1.0"):
        TokenShaping(probability=1.5)
    with pytest.raises(ValueError, match="shaping.w_pos: expected a value >= 0.0"):
        TokenShaping(w_pos=-1.0)
    with pytest.raises(ValueError, match=r"shaping.a3po_pos_high: expected a \(ratio, scale\) tuple"):
        TokenShaping(a3po_pos_high=0.2)
    with pytest.raises(ValueError, match=r"shaping.a3po_neg_low\[0\] \(ratio\): expected a value <= 1.0"):
        TokenShaping(a3po_neg_low=(2.0, 1.0))
    with pytest.raises(ValueError, match="shaping.entropy_quantile: expected a value > 0.0"):
        TokenShaping(entropy_quantile=0.0)
    with pytest.raises(ValueError, match="shaping.a3po_metric: expected one of"):
        TokenShaping(a3po_metric="logit")
    kw = base()
    with pytest.raises(ValueError, match="entropy: shaping.a3po_metric='entropy' needs"):
        rk.shape_token_advantages(
            kw["advantages"],
            kw["old_logprobs"],
            kw["mask"],
            TokenShaping(a3po_metric="entropy", a3po_pos_high=(0.2, 2.0)),
        )


def test_devices_must_match():
    kw = base()
    kw["advantages"] = torch.randn(3, device="meta")
    with pytest.raises(ValueError, match="advantages: expected a tensor on cpu"):
        rk.policy_loss(**kw)


def test_messages_name_the_callers_arguments():
    kw = base()
    with pytest.raises(TypeError, match="old_logprobs: expected dtype"):
        rk.shape_token_advantages(kw["advantages"], kw["old_logprobs"].long(), kw["mask"])
    with pytest.raises(ValueError, match=r"mask: expected shape \(3, 5\) \(like old_logprobs\)"):
        rk.shape_token_advantages(kw["advantages"], kw["old_logprobs"], kw["mask"][:, :4])
    with pytest.raises(ValueError, match=r"entropy: expected shape \(3, 5\) \(like logprobs\)"):
        call(entropy=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="cu_seqlens: expected a tensor on cpu"):
        rk.policy_loss(torch.randn(4), torch.randn(4), torch.randn(1), cu_seqlens=torch.tensor([0, 4], device="meta"))


@pytest.mark.parametrize("backend,device", ALL)
def test_an_input_the_options_do_not_read_is_not_value_checked(backend, device):
    """A NaN in ref_logprobs without a KL estimator (or in rollout_logprobs without a rollout
    correction) is not read, so it is not an error, on every backend."""
    kw = {k: v.to(device) for k, v in base().items()}
    nan = torch.full_like(kw["logprobs"], float("nan"))
    loss, _ = rk.policy_loss(**kw, ref_logprobs=nan, rollout_logprobs=nan, backend=backend)
    assert torch.isfinite(loss)
