"""slime's custom loss hook (rlvr_kernels.integrations.slime.policy_loss_function) against an
fp64 transcription of slime's policy_loss_function (tests/_slime.py): the loss, its gradient
to the logits and the reported metrics, on random packed micro-batches (odd lengths, padded
logits, masked tokens, multi-sample rollouts), through the reducer slime passes."""

import dataclasses
import types

import pytest
import torch
from _slime import policy_loss as ref_policy_loss
from _slime import reject_masks, sum_of_sample_mean

from rlvr_kernels.integrations import slime


def _args(**kw):
    base = dict(
        advantage_estimator="grpo",
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=None,
        use_tis=False,
        get_mismatch_metrics=False,
        custom_tis_function_path=None,
        custom_pg_loss_reducer_function_path=None,
        tis_clip=2.0,
        tis_clip_low=0.0,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="k1",
        use_unbiased_kl=False,
        entropy_coef=0.0,
        use_rollout_logprobs=False,
        calculate_per_token_loss=False,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        use_opsm=False,
        use_opd=False,
        allgather_cp=False,
        context_parallel_size=1,
        tensor_model_parallel_size=1,
    )
    return types.SimpleNamespace(**{**base, **kw})


@dataclasses.dataclass
class Case:
    batch: dict
    logits: torch.Tensor  # [1, T, V] fp32
    denoms: list


def _case(seed=0, V=37, responses=(5, 1, 7, 3), prompts=(3, 2, 4, 6), pad=3, seq_adv=True, rollouts=(0, 0, 1, 2)):
    g = torch.Generator().manual_seed(seed)
    tokens, masks, T = [], [], 0
    for p, r in zip(prompts, responses):
        tokens.append(torch.randint(0, V, (p + r,), generator=g))
        m = (torch.rand(r, generator=g) > 0.25).int()
        m[0] = 1
        masks.append(m)
        T += p + r
    logits = torch.randn(1, T + pad, V, generator=g) * 2
    lsm, true, end = torch.log_softmax(logits[0], -1), [], 0
    for t, p, r in zip(tokens, prompts, responses):
        end += p + r
        true.append(lsm[torch.arange(end - r - 1, end - 1), t[-r:]])

    def near(base, scale):
        # log-probs near the batch's own (ratios around 1: both clip sides, TIS bounds hit)
        return [b + scale * torch.randn(b.shape, generator=g) for b in base]

    if seq_adv:
        advantages = [torch.full((r,), float(torch.randn((), generator=g))) for r in responses]
    else:
        advantages = [torch.randn(r, generator=g) for r in responses]
    batch = dict(
        unconcat_tokens=tokens,
        total_lengths=[p + r for p, r in zip(prompts, responses)],
        response_lengths=list(responses),
        loss_masks=masks,
        advantages=advantages,
        log_probs=near(true, 0.25),
        ref_log_probs=near(true, 0.5),
    )
    batch["rollout_log_probs"] = near(batch["log_probs"], 0.4)
    # slime's rollout_mask_sums: each sample's rollout total over its sibling samples
    sums = {}
    for rid, m in zip(rollouts, masks):
        sums[rid] = sums.get(rid, 0) + int(m.sum())
    denoms = [float(sums[rid]) for rid in rollouts]
    batch["rollout_mask_sums"] = torch.tensor(denoms)
    return Case(batch, logits, denoms)


def _run(args, case, tis=None, tis_masks=None, pg_denoms="rollout", rel=2e-5):
    b = case.batch
    ssm = sum_of_sample_mean(b["response_lengths"], b["loss_masks"], case.denoms, args.calculate_per_token_loss)
    logits = case.logits.clone().requires_grad_()
    loss, metrics = slime.policy_loss_function(args, b, logits, ssm)
    loss.backward()

    ref_logits = case.logits.double().requires_grad_()
    ref_b = dict(b)
    want, want_metrics = ref_policy_loss(args, ref_b, ref_logits, case.denoms, tis, tis_masks, pg_denoms)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=rel, abs=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-4, atol=2e-6)
    assert set(metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        assert float(metrics[k]) == pytest.approx(float(v), rel=rel, abs=1e-6), k
    return metrics


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(eps_clip_high=0.2, eps_clip_c=3.0),
        dict(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=4.0),
        dict(advantage_estimator="cispo"),
        dict(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4),
        dict(rollout_temperature=0.7, entropy_coef=0.01),
        dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"),
        dict(use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k3", use_unbiased_kl=True, entropy_coef=0.003),
        dict(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k2"),
        dict(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k1", calculate_per_token_loss=True),
        dict(use_rollout_logprobs=True),
    ],
)
def test_policy_loss_matches_slime(kw):
    _run(_args(**kw), _case(seed=len(str(kw)), seq_adv=kw.get("advantage_estimator") == "gspo" or len(kw) % 2 == 0))


def test_token_advantages_and_on_policy():
    """Per-token advantages (ppo / reinforce++), and no stored log-probs: old = the current
    log-probs detached (ratio 1)."""
    case = _case(seed=5, seq_adv=False)
    _run(_args(advantage_estimator="ppo", eps_clip_c=2.5), case)
    case.batch.pop("log_probs")
    _run(_args(advantage_estimator="reinforce_plus_plus", entropy_coef=0.02), case)


@pytest.mark.parametrize(
    "kw,tis",
    [
        (dict(use_tis=True, tis_clip=1.5, tis_clip_low=0.5), "vanilla"),
        (dict(use_tis=True, custom_tis_function_path="rlvr_kernels.integrations.slime.icepop_function"), "icepop"),
        (dict(get_mismatch_metrics=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01), "vanilla"),
        (
            dict(
                use_tis=True,
                tis_clip=1.2,
                custom_pg_loss_reducer_function_path="rlvr_kernels.integrations.slime.pg_loss_reducer",
            ),
            "vanilla",
        ),
    ],
)
def test_tis_fused_and_reducer(kw, tis):
    args = _args(**kw)
    case = _case(seed=11)
    own = args.custom_pg_loss_reducer_function_path is not None
    # a custom pg reducer divides by each sample's own mask count (not the rollout totals)
    metrics = _run(args, case, tis=tis, tis_masks=case.batch["loss_masks"] if own else None, pg_denoms="own")
    assert 0 < metrics["tis_clipfrac"] < len(case.denoms)  # some tokens out of the bounds, not all


def test_custom_tis_that_rejects_tokens():
    """A TIS function of the user's (tests/_slime.py reject_tis): the pg term is its own call,
    handed to it; slime rebuilds the pg reducer on the masks it returns, with the rollouts'
    denominators; the KL and entropy terms keep the original masks."""
    args = _args(
        use_tis=True,
        custom_tis_function_path="_slime.reject_tis",
        tis_clip=1.4,
        reject_above=1.0,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="k3",
        entropy_coef=0.01,
    )
    case = _case(seed=3)
    masks = reject_masks(args, case.batch)
    assert sum(int(m.sum()) for m in masks) < sum(int(m.sum()) for m in case.batch["loss_masks"])
    _run(args, case, tis="vanilla", tis_masks=masks, pg_denoms="rollout")


def test_hand_computed_single_token():
    """One sample, one response token, V = 2 with logits (0, 0): logp = log ½, ratio against
    old = log ½ − 0.1 is e^0.1 = 1.105 < 1.28, A = 2: loss = −2·e^0.1 = −2.2103."""
    batch = dict(
        unconcat_tokens=[torch.tensor([0, 1])],
        total_lengths=[2],
        response_lengths=[1],
        loss_masks=[torch.tensor([1])],
        advantages=[torch.tensor([2.0])],
        log_probs=[torch.tensor([torch.log(torch.tensor(0.5)).item() - 0.1])],
    )
    logits = torch.zeros(1, 2, 2, requires_grad=True)
    ssm = slime.pg_loss_reducer([2], [1], batch["loss_masks"], False)
    loss, metrics = slime.policy_loss_function(_args(), batch, logits, ssm)
    assert loss.item() == pytest.approx(-2 * torch.exp(torch.tensor(0.1)).item(), rel=1e-6)
    assert metrics["pg_clipfrac"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(-0.1, rel=1e-5)
    loss.backward()
    # d/dz of −2·ρ·softmax(z)_1-log terms: ρ·(−2)·(onehot − p) = ∓1.105 on row 0, 0 on row 1
    assert logits.grad[0, 0].tolist() == pytest.approx([1.10517, -1.10517], rel=1e-5)
    assert logits.grad[0, 1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(context_parallel_size=2), "context_parallel_size"),
        (dict(tensor_model_parallel_size=2), "tensor_model_parallel_size"),
        (dict(allgather_cp=True), "allgather_cp"),
        (dict(rollout_top_p=0.9), "rollout_top_p"),
        (dict(use_opsm=True), "use_opsm"),
        (dict(advantage_estimator="gspo", use_tis=True), "use_tis"),
        (dict(advantage_estimator="gspo", use_unbiased_kl=True), "use_unbiased_kl"),
    ],
)
def test_refused(kw, name):
    case = _case()
    b = case.batch
    ssm = sum_of_sample_mean(b["response_lengths"], b["loss_masks"], case.denoms)
    with pytest.raises(ValueError, match=f"args.{name}"):
        slime.policy_loss_function(_args(**kw), b, case.logits, ssm)


def test_bad_input():
    case = _case()
    b = case.batch
    ssm = sum_of_sample_mean(b["response_lengths"], b["loss_masks"], case.denoms)
    with pytest.raises(ValueError, match="logits"):
        slime.policy_loss_function(_args(), b, case.logits[0], ssm)
    with pytest.raises(ValueError, match="logits"):
        slime.policy_loss_function(_args(), b, case.logits.double(), ssm)
    with pytest.raises(ValueError, match="loss_masks"):
        slime.policy_loss_function(
            _args(), dict(b, loss_masks=b["loss_masks"][:-1] + [torch.ones(1)]), case.logits, ssm
        )
    with pytest.raises(ValueError, match=r"response_lengths'\]\[0\]"):
        slime.policy_loss_function(_args(), dict(b, total_lengths=[5] + b["total_lengths"][1:]), case.logits, ssm)
    with pytest.raises(ValueError, match="args.kl_loss_type"):
        slime.policy_loss_function(_args(use_kl_loss=True, kl_loss_type="k4"), b, case.logits, ssm)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        nb = {k: v for k, v in b.items() if k != "rollout_log_probs"}
        slime.policy_loss_function(_args(use_tis=True), nb, case.logits, ssm)
