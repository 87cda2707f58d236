"""group_advantages against hand-computed values, on every backend."""

import math

import pytest
import torch
from _backends import ALL, to

import rlvr_kernels as rk


def run(backend, device, **kw):
    out = rk.group_advantages(**to(kw, device), backend=backend, out_dtype=torch.float64)
    return out._replace(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out._asdict().items()})


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual.double(), expected, atol=tol, rtol=0), (actual, expected)


@pytest.mark.parametrize("backend,device", ALL)
class TestHandComputed:
    def test_seed_learning_task_mean_only_and_mean_std(self, backend, device):
        # One group of binary rewards (one success in four), the seed's exercise.
        r = torch.tensor([1.0, 0.0, 0.0, 0.0])
        gi = torch.zeros(4, dtype=torch.long)
        mean_only = run(backend, device, scores=r, group_index=gi, estimator="dr_grpo")
        close(mean_only.advantages, [0.75, -0.25, -0.25, -0.25])
        # Unbiased std: sqrt((0.75² + 3·0.25²)/3) = 0.5.
        mean_std = run(backend, device, scores=r, group_index=gi, estimator="grpo", eps=0.0)
        close(mean_std.advantages, [1.5, -0.5, -0.5, -0.5])
        close(mean_std.group_mean, [0.25])
        close(mean_std.group_std, [0.5])
        pop = run(backend, device, scores=r, group_index=gi, std="population", eps=0.0)
        close(pop.advantages, [0.75 / math.sqrt(0.1875), -0.25 / math.sqrt(0.1875)] + [-0.25 / math.sqrt(0.1875)] * 2)
        # What a token-level loss receives: the same A_i on every valid token, 0 on padding.
        mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
        tok = run(backend, device, scores=r, group_index=gi, eps=0.0, response_mask=mask).token_advantages
        close(tok, [[1.5, 1.5, 0], [-0.5, 0, 0], [-0.5, -0.5, -0.5], [0, 0, 0]])

    def test_eps_inside_sqrt(self, backend, device):
        # σ² = 0.25 (unbiased); with eps inside the sqrt the divisor is sqrt(0.25 + 0.1875).
        r = torch.tensor([1.0, 0.0, 0.0, 0.0])
        out = run(backend, device, scores=r, group_size=4, eps=0.1875, eps_in_sqrt=True)
        d = math.sqrt(0.4375)
        close(out.advantages, [0.75 / d, -0.25 / d, -0.25 / d, -0.25 / d])

    def test_rloo_opo_gpg(self, backend, device):
        r = torch.tensor([1.0, 0.0, 1.0])
        close(run(backend, device, scores=r, group_size=3, estimator="rloo").advantages, [0.5, -1.0, 0.5])
        r2 = torch.tensor([1.0, 0.0])
        opo = run(backend, device, scores=r2, group_size=2, estimator="opo", lengths=torch.tensor([3, 1]))
        close(opo.advantages, [0.25, -0.75])  # baseline Σ len·r / Σ len = 3/4
        gpg = run(backend, device, scores=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, estimator="gpg")
        close(gpg.advantages, [3.0, -1.0, -1.0, -1.0])  # α = 4 / 1

    def test_passk_analytic(self, backend, device):
        # n = 4, one correct, k = 2: R̄ = 1 − C(3,2)/C(4,2) = 1/2, σ = 1/2,
        # correct (1 − R̄)/σ = 1, incorrect (1 − R̄ − C(2,1)/C(3,1))/σ = −1/3.
        out = run(
            backend, device, scores=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, estimator="passk", k=2, eps=0.0
        )
        close(out.advantages, [1.0, -1 / 3, -1 / 3, -1 / 3])
        # Fewer samples than k: no k-subset, no signal.
        few = run(backend, device, scores=torch.tensor([1.0, 0.0]), group_size=2, estimator="passk", k=3)
        close(few.advantages, [0.0, 0.0])

    def test_reinforce_pp_baseline_token_whitening(self, backend, device):
        r = torch.tensor([1.0, 0.0, 0.0, 0.0])
        gi = torch.tensor([0, 0, 1, 1])
        lengths = torch.tensor([1, 3, 2, 2])
        out = run(backend, device, scores=r, group_index=gi, estimator="reinforce_pp_baseline", lengths=lengths)
        # s = [0.5, −0.5, 0, 0]; token mean −1/8; unbiased token var 0.875/7 = 1/8.
        sigma = math.sqrt(0.125 + 1e-8)
        close(out.advantages, [0.625 / sigma, -0.375 / sigma, 0.125 / sigma, 0.125 / sigma])

    def test_scale_batch_and_degenerate_groups(self, backend, device):
        r = torch.tensor([1.0, 0.0, 1.0, 1.0])
        out = run(backend, device, scores=r, group_size=2, scale="batch", eps=0.0)
        close(out.advantages, [1.0, -1.0, 0.0, 0.0])  # batch σ of [1,0,1,1] is 0.5
        assert out.group_degenerate.tolist() == [False, True]
        assert out.sample_keep.tolist() == [True, True, False, False]
        assert out.group_count.tolist() == [2, 2]

    def test_singletons(self, backend, device):
        r = torch.tensor([2.0, 1.0, 0.0])
        gi = torch.tensor([0, 1, 1])
        close(
            run(backend, device, scores=r, group_index=gi, singleton="zero", eps=0.0).advantages,
            [0.0, 0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)],
        )
        # verl's loop: a lone sample is compared with mean 0 and std 1.
        close(run(backend, device, scores=r, group_index=gi, preset="verl").advantages[:1], [2.0 / (1 + 1e-6)])
        close(run(backend, device, scores=r, group_index=gi, preset="verl", estimator="rloo").advantages[:1], [2.0])
        single = run(backend, device, scores=r, group_index=gi, preset="verl")
        assert single.group_degenerate.tolist() == [True, False]  # one value is "all equal"

    def test_sample_mask_excludes_from_statistics(self, backend, device):
        r = torch.tensor([1.0, 0.0, 5.0, 0.0])
        keep = torch.tensor([True, True, False, True])
        out = run(backend, device, scores=r, group_size=4, estimator="dr_grpo", sample_mask=keep)
        close(out.advantages, [2 / 3, -1 / 3, 0.0, -1 / 3])
        assert out.group_count.tolist() == [3]
        assert out.sample_keep.tolist() == [True, True, False, True]

    def test_gdpo_two_terms(self, backend, device):
        terms = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        out = run(
            backend,
            device,
            scores=terms,
            group_size=2,
            estimator="gdpo",
            eps=0.0,
            reward_weights=torch.tensor([1.0, 2.0]),
            whitening=rk.Whitening("samples", 0.0, True),
        )
        # Per term A = ±1/√2; total = A_1 + 2·A_2 = [−1/√2, 1/√2]; whitened: mean 0, var 1.
        close(out.advantages, [-1 / math.sqrt(2), 1 / math.sqrt(2)])
        assert out.group_mean.shape == (1, 2)
        close(out.group_mean, [[0.5, 0.5]])

    def test_packed_layout(self, backend, device):
        r = torch.tensor([1.0, 0.0, 0.0])
        cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # the second sample has no tokens
        mask = torch.tensor([1, 1, 1, 0, 1], dtype=torch.bool)
        out = run(backend, device, scores=r, group_size=3, estimator="dr_grpo", cu_seqlens=cu, response_mask=mask)
        close(out.token_advantages, [2 / 3, 2 / 3, -1 / 3, 0.0, -1 / 3])
        no_mask = run(backend, device, scores=r, group_size=3, estimator="dr_grpo", cu_seqlens=cu)
        close(no_mask.token_advantages, [2 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3])

    def test_unscorable_rewards(self, backend, device):
        r = torch.tensor([1.0, float("nan"), 0.0, 0.0])
        out = run(backend, device, scores=r, group_size=4, preset="trl_async")
        # Scorable [1, 0, 0]: mean 1/3, population std √2/3.
        s = math.sqrt(2) / 3
        close(out.advantages, [(2 / 3) / (s + 1e-8), 0.0, (-1 / 3) / (s + 1e-8), (-1 / 3) / (s + 1e-8)])
        assert out.sample_keep.tolist() == [True, False, True, True]


@pytest.mark.parametrize("backend,device", ALL)
def test_empty_and_all_masked_inputs_give_zeros(backend, device):
    empty = run(
        backend,
        device,
        scores=torch.zeros(0),
        group_index=torch.zeros(0, dtype=torch.long),
        num_groups=0,
        response_mask=torch.zeros(0, 7),
    )
    assert empty.advantages.shape == (0,) and empty.token_advantages.shape == (0, 7)
    assert empty.group_mean.shape == (0,)
    # No samples but some groups: every group is empty, degenerate, with zero statistics.
    no_rows = run(
        backend,
        device,
        scores=torch.zeros(0),
        group_index=torch.zeros(0, dtype=torch.long),
        num_groups=3,
        cu_seqlens=torch.zeros(1, dtype=torch.int32),
        response_mask=torch.zeros(0),
    )
    assert no_rows.group_count.tolist() == [0, 0, 0] and no_rows.group_degenerate.all()
    assert (no_rows.group_mean == 0).all() and no_rows.token_advantages.shape == (0,)
    # Groups that exist but have no valid sample: zeros, degenerate, nothing kept, no NaN.
    r = torch.tensor([1.0, 0.0, 1.0])
    for est in ("grpo", "rloo", "opo", "gpg", "reinforce_pp_baseline", "gdpo"):
        out = run(
            backend,
            device,
            scores=r,
            group_index=torch.tensor([0, 0, 2]),
            num_groups=4,
            estimator=est,
            sample_mask=torch.zeros(3, dtype=torch.bool),
            response_mask=torch.ones(3, 5),
        )
        for name in ("advantages", "token_advantages", "group_mean", "group_std"):
            t = getattr(out, name)
            assert torch.isfinite(t).all() and (t == 0).all(), (est, name, t)
        assert out.group_count.tolist() == [0, 0, 0, 0]
        assert out.group_degenerate.all() and not out.sample_keep.any()


@pytest.mark.parametrize("backend,device", ALL)
def test_options_argument_equals_the_keywords(backend, device):
    # options= takes the resolved fields; the result equals the preset/keyword call bitwise.
    gen = torch.Generator().manual_seed(3)
    data = dict(
        scores=torch.rand(12, generator=gen),
        group_index=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]),
        response_mask=(torch.rand(12, 5, generator=gen) > 0.3).float(),
    )
    calls = [
        (None, dict(estimator="rloo")),
        ("verl", dict(eps=1e-3)),
        ("trl", dict(scale="batch")),
        (None, dict(estimator="passk", k=2)),
        ("verl", dict(estimator="reinforce_pp_baseline")),
    ]
    for preset, kw in calls:
        by_keywords = run(backend, device, **data, preset=preset, **kw)
        options = rk.options.resolve_advantage_options(preset, **kw)
        assert isinstance(options, rk.AdvantageOptions)
        by_options = run(backend, device, **data, options=options)
        for name, want in by_keywords._asdict().items():
            got = getattr(by_options, name)
            assert torch.equal(got, want), (preset, kw, name)
