"""``rollout_mismatch`` against the peers' own metric code on the same inputs:
verl 0.9.1's ``compute_rollout_corr_metrics_from_logprobs`` (trainer/ppo/rollout_corr_helper.py)
and its token-level ``compute_is_metrics``; TRL 1.16's vLLM importance-sampling metrics of
``GRPOTrainer._generate_and_score_completions`` (trainer/grpo_trainer.py: inline code, so its
formulas are restated here over TRL's own ``nanmin`` / ``nanmax``); slime's
``train_rollout_logprob_abs_diff`` (slime/backends/megatron_utils/loss.py,
``policy_loss_function``, with ``cp_utils.get_sum_of_sample_mean`` and the division by the
number of samples of the trainer: not installed, so its formula is restated)."""

import pytest
import torch
from trl.trainer.utils import nanmax, nanmin
from verl.trainer.ppo.rollout_corr_helper import compute_is_metrics, compute_rollout_corr_metrics_from_logprobs

import rlvr_kernels as rk
from tests._backends import ALL


def _batch(seed, empty_row):
    gen = torch.Generator().manual_seed(seed)
    B, L = 6, 23
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    if empty_row:
        lengths[2] = 0
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    train = -3 * torch.rand(B, L, generator=gen, dtype=torch.float64)
    rollout = train + 0.2 * torch.randn(B, L, generator=gen, dtype=torch.float64)
    return train * mask, rollout * mask, mask


VERL = {
    "kl": "k1",
    "k3_kl": "k3",
    "training_ppl": "training_ppl",
    "training_log_ppl": "training_log_ppl",
    "rollout_ppl": "rollout_ppl",
    "rollout_log_ppl": "rollout_log_ppl",
    "log_ppl_diff": "log_ppl_diff",
    "log_ppl_abs_diff": "log_ppl_abs_diff",
    "log_ppl_diff_max": "log_ppl_diff_max",
    "log_ppl_diff_min": "log_ppl_diff_min",
    "ppl_ratio": "ppl_ratio",
    "chi2_token": "chi2_token",
    "chi2_seq": "chi2_seq",
}


@pytest.mark.parametrize("empty_row", [False, True], ids=["full", "empty-row"])
@pytest.mark.parametrize("backend, device", ALL)
def test_verl_offpolicy_metrics(backend, device, empty_row):
    train, rollout, mask = _batch(0, empty_row)
    theirs = compute_rollout_corr_metrics_from_logprobs(train, rollout, mask)
    ours = rk.rollout_mismatch(train.to(device), rollout.to(device), mask.to(device), backend=backend)
    for key, field in VERL.items():
        # verl's masked_mean divides by (count + 1e-8): a relative 1e-8 / count.
        assert float(getattr(ours, field)) == pytest.approx(theirs[f"rollout_corr/{key}"], rel=1e-7, abs=1e-9), key


@pytest.mark.parametrize("backend, device", ALL)
def test_verl_token_is_metrics(backend, device):
    train, rollout, mask = _batch(1, True)
    low, high = 0.8, 1.25
    raw = torch.exp(train - rollout) * mask
    theirs = compute_is_metrics(raw, raw, train - rollout, mask, "token", high, low)
    ours = rk.rollout_mismatch(
        train.to(device), rollout.to(device), mask.to(device), ratio_bounds=(low, high), backend=backend
    )
    assert float(ours.ratio_frac_high) == pytest.approx(theirs["rollout_is_ratio_fraction_high"], rel=1e-7)
    assert float(ours.ratio_frac_low) == pytest.approx(theirs["rollout_is_ratio_fraction_low"], rel=1e-7)
    assert float(ours.ratio_mean) == pytest.approx(theirs["rollout_is_mean"], rel=1e-7)
    assert float(ours.ratio_max) == pytest.approx(theirs["rollout_is_max"], rel=1e-12)
    assert float(ours.ratio_min) == pytest.approx(theirs["rollout_is_min"], rel=1e-12)


def _trl_metrics(old, sampling, completion_mask, sequence_level):
    """TRL 1.16's logged values (grpo_trainer.py, the `vllm_importance_sampling_correction`
    branches), before any truncation or masking by its clip bounds."""
    mask = completion_mask.bool()
    delta = torch.abs(old - sampling)[mask]
    diff = (old - sampling) * completion_mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence_level else diff)
    flat = ratio.flatten() if sequence_level else ratio[mask]
    return dict(
        diff_mean=delta.mean(),
        diff_max=delta.max(),
        ratio_min=nanmin(flat),
        ratio_mean=flat.mean(),
        ratio_max=nanmax(flat),
    )


@pytest.mark.parametrize("sequence_level", [False, True], ids=["token", "sequence"])
@pytest.mark.parametrize("backend, device", ALL)
def test_trl_importance_sampling_metrics(backend, device, sequence_level):
    train, rollout, mask = _batch(2, True)
    theirs = _trl_metrics(train, rollout, mask, sequence_level)
    ours = rk.rollout_mismatch(train.to(device), rollout.to(device), mask.to(device), backend=backend)
    prefix = "seq_ratio" if sequence_level else "ratio"
    assert float(ours.abs_diff_mean) == pytest.approx(float(theirs["diff_mean"]), rel=1e-12)
    assert float(ours.abs_diff_max) == pytest.approx(float(theirs["diff_max"]), rel=1e-12)
    for stat in ("min", "mean", "max"):
        assert float(getattr(ours, f"{prefix}_{stat}")) == pytest.approx(float(theirs[f"ratio_{stat}"]), rel=1e-12)


@pytest.mark.parametrize("backend, device", ALL)
def test_slime_train_rollout_logprob_abs_diff(backend, device):
    """Σ over samples of (Σ |Δ|·m) / max(Σ m, 1), over the number of samples; packed as
    slime packs (one response after the other)."""
    train, rollout, mask = _batch(3, True)
    per_sample = ((train - rollout).abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    slime = float(per_sample.sum() / train.shape[0])
    lengths = mask.sum(-1).long()
    keep = mask.bool()
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    ours = rk.rollout_mismatch(
        train[keep].to(device), rollout[keep].to(device), cu_seqlens=cu.to(device), backend=backend
    )
    assert float(ours.seq_abs_diff_mean) == pytest.approx(slime, rel=1e-12)
    assert ours.per_seq_abs_diff_mean.cpu().double().tolist() == pytest.approx(per_sample.tolist(), rel=1e-12)
