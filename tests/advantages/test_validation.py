"""Bad input: a clear TypeError/ValueError naming the argument, raised before any kernel
runs, with the inputs left untouched (docs/behaviour.md)."""

import numpy as np
import pytest
import torch

import rlvr_kernels as rk
from rlvr_kernels.ops import advantages as ops_adv


def good():
    gen = torch.Generator().manual_seed(0)
    return dict(
        scores=torch.randint(0, 2, (6,), generator=gen).float(),
        group_index=torch.tensor([0, 0, 1, 1, 2, 2]),
        response_mask=torch.ones(6, 4),
    )


CASES = [
    # (overrides, extra kwargs, exception, text the message must contain)
    (dict(scores=torch.zeros(6, 2, 2)), {}, ValueError, "scores"),
    (dict(scores=torch.zeros(6, dtype=torch.int64)), {}, TypeError, "scores"),
    (dict(scores=[0.0] * 6), {}, TypeError, "scores"),
    (dict(group_index=torch.tensor([0, 0, 1, 1, 2])), {}, ValueError, "group_index"),
    (dict(group_index=torch.zeros(6)), {}, TypeError, "group_index"),
    (dict(group_index=torch.tensor([0, 0, 1, 1, 2, 3])), dict(num_groups=3), ValueError, "group_index"),
    (dict(group_index=torch.tensor([0, 0, 1, -1, 2, 2])), {}, ValueError, "group_index"),
    (dict(scores=torch.tensor([1.0, float("nan"), 0, 0, 1, 1])), {}, ValueError, "scores"),
    (dict(scores=torch.tensor([1.0, float("inf"), 0, 0, 1, 1])), {}, ValueError, "scores"),
    (dict(response_mask=torch.ones(5, 4)), {}, ValueError, "response_mask"),
    (dict(response_mask=torch.ones(6)), {}, ValueError, "response_mask"),
    (dict(response_mask=torch.ones(6, 4, dtype=torch.complex64)), {}, TypeError, "response_mask"),
    ({}, dict(sample_mask=torch.ones(5, dtype=torch.bool)), ValueError, "sample_mask"),
    ({}, dict(sample_mask=torch.ones(6, 1, dtype=torch.bool)), ValueError, "sample_mask"),
    ({}, dict(lengths=torch.ones(7)), ValueError, "lengths"),
    ({}, dict(lengths=torch.tensor([1.0, -1, 1, 1, 1, 1])), ValueError, "lengths"),
    ({}, dict(reward_weights=torch.ones(1)), ValueError, "reward_weights"),
    (dict(scores=torch.zeros(6, 2)), dict(reward_weights=torch.ones(3)), ValueError, "reward_weights"),
    (
        dict(scores=torch.zeros(6, 2)),
        dict(reward_weights=torch.tensor([1.0, float("nan")])),
        ValueError,
        "reward_weights",
    ),
    (dict(response_mask=None), dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5])), ValueError, "cu_seqlens"),
    (dict(response_mask=None), dict(cu_seqlens=torch.tensor([0.0, 1, 2, 3, 4, 5, 6])), TypeError, "cu_seqlens"),
    (dict(response_mask=None), dict(cu_seqlens=torch.tensor([1, 1, 2, 3, 4, 5, 6])), ValueError, "cu_seqlens"),
    (dict(response_mask=None), dict(cu_seqlens=torch.tensor([0, 2, 1, 3, 4, 5, 6])), ValueError, "cu_seqlens"),
    (dict(response_mask=torch.ones(5)), dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 6])), ValueError, "cu_seqlens"),
    (
        dict(response_mask=torch.ones(6, 1)),
        dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 6])),
        ValueError,
        "response_mask",
    ),
    (dict(group_index=torch.tensor([0, 0, 1, 1, 2, 2], device="meta")), {}, ValueError, "group_index"),
    (dict(response_mask=torch.ones(6, 4, device="meta")), {}, ValueError, "response_mask"),
    (dict(group_index=None), {}, ValueError, "group_size"),
    ({}, dict(options=rk.AdvantageOptions(), eps=1e-3), ValueError, "options"),
    ({}, dict(options=rk.AdvantageOptions(), preset="verl"), ValueError, "options"),
    ({}, dict(options={"estimator": "grpo"}), TypeError, "options"),
    (dict(group_index=None), dict(group_size=4), ValueError, "group_size"),
    (dict(group_index=None), dict(group_size=0), ValueError, "group_size"),
    (dict(group_index=None), dict(group_size=2, num_groups=2), ValueError, "num_groups"),
    ({}, dict(group_size=2), ValueError, "group_size"),
    ({}, dict(num_groups=-1), ValueError, "num_groups"),
    ({}, dict(estimator="ppo"), ValueError, "estimator"),
    ({}, dict(preset="unknown_peer"), ValueError, "preset"),
    ({}, dict(std="sample"), ValueError, "std"),
    ({}, dict(scale="token"), ValueError, "scale"),
    ({}, dict(singleton="drop"), ValueError, "singleton"),
    ({}, dict(nan_policy="ignore"), ValueError, "nan_policy"),
    ({}, dict(eps=-1e-6), ValueError, "eps"),
    ({}, dict(eps=float("nan")), ValueError, "eps"),
    ({}, dict(estimator="passk"), ValueError, "k"),
    ({}, dict(estimator="passk", k=0), ValueError, "k"),
    ({}, dict(estimator="grpo", k=4), ValueError, "k"),
    ({}, dict(estimator="rloo", scale="group"), ValueError, "scale"),
    ({}, dict(estimator="dr_grpo", scale="group"), ValueError, "scale"),
    (dict(response_mask=None), dict(estimator="opo"), ValueError, "lengths"),
    ({}, dict(whitening="tokens"), TypeError, "whitening"),
    ({}, dict(whitening=None, estimator="reinforce_pp_baseline", eps=float("inf")), ValueError, "eps"),
    ({}, dict(out_dtype=torch.int32), TypeError, "out_dtype"),
    ({}, dict(backend="cuda"), ValueError, "backend"),
    # Absurd sizes: refused up front, naming the argument, not by the kernel's allocator.
    ({}, dict(num_groups=2**40), ValueError, "num_groups"),
    ({}, dict(num_groups=2**62), ValueError, "num_groups"),
    (dict(group_index=torch.tensor([0, 0, 1, 1, 2, 2**40])), dict(validate=False), ValueError, "group_index"),
    (dict(group_index=torch.tensor([0, 0, 1, 1, 2, 2**31 - 1])), {}, ValueError, "group_index"),
    (dict(group_index=None), dict(group_size=2**40), ValueError, "group_size"),
    (dict(response_mask=None), dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 2**40])), ValueError, "cu_seqlens"),
    (
        dict(response_mask=None),
        dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, 2**40]), validate=False),
        ValueError,
        "cu_seqlens",
    ),
    (
        dict(response_mask=None),
        dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 4, 5, -1]), validate=False),
        ValueError,
        "cu_seqlens",
    ),
    # Meta tensors hold no values: what would need them is asked for, naming the argument.
    (
        dict(
            scores=torch.zeros(6, device="meta"),
            group_index=torch.zeros(6, dtype=torch.long, device="meta"),
            response_mask=None,
        ),
        {},
        ValueError,
        "num_groups",
    ),
    (
        dict(scores=torch.zeros(6, device="meta"), group_index=None, response_mask=None),
        dict(group_size=2, cu_seqlens=torch.zeros(7, dtype=torch.long, device="meta")),
        ValueError,
        "cu_seqlens",
    ),
]


@pytest.mark.parametrize("overrides,extra,exc,name", CASES, ids=[f"{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_raises_before_any_kernel(monkeypatch, overrides, extra, exc, name):
    kw = good()
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if v is not None}
    snapshot = {
        k: v.clone() for k, v in {**kw, **extra}.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"
    }
    calls = []
    monkeypatch.setattr(ops_adv, "_group_advantages_op", lambda *a, **k: calls.append(a))
    with pytest.raises(exc) as info:
        rk.group_advantages(**kw, **extra)
    assert name in str(info.value).split(":")[0], f"message should start with the argument name: {info.value}"
    assert not calls, "a kernel ran before validation failed"
    for key, before in snapshot.items():
        after = {**kw, **extra}[key]
        assert torch.equal(before, after) or (before.isnan() == after.isnan()).all(), f"{key} was modified"


def test_nan_allowed_where_masked_or_unscorable():
    r = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    out = rk.group_advantages(r, group_size=2, sample_mask=torch.tensor([True, False, True, True]))
    assert torch.isfinite(out.advantages).all() and out.advantages[1] == 0
    out = rk.group_advantages(r, group_size=2, nan_policy="unscorable")
    assert torch.isfinite(out.advantages).all() and out.advantages[1] == 0


def test_validate_false_skips_value_checks():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    out = rk.group_advantages(r, torch.tensor([0, 0, 7, 1]), num_groups=2, validate=False)
    assert out.advantages[2] == 0 and not out.sample_keep[2]


def test_uids_to_group_index_errors():
    with pytest.raises(ValueError, match="uids"):
        rk.uids_to_group_index(np.zeros((2, 2)))
    with pytest.raises(TypeError, match="uids"):
        rk.uids_to_group_index(torch.zeros(3))


@pytest.mark.parametrize(
    "name, extra",
    [
        ("sample_mask", dict(sample_mask=torch.ones(6, dtype=torch.bool, device="meta"))),
        ("lengths", dict(lengths=torch.ones(6, device="meta"))),
        ("cu_seqlens", dict(cu_seqlens=torch.zeros(7, dtype=torch.long, device="meta"), response_mask=None)),
    ],
)
def test_device_mismatch_names_the_argument_and_scores(name, extra):
    kw = {**good(), **extra}
    with pytest.raises(ValueError, match=rf"^{name}: expected a tensor on cpu \(where scores lives\)"):
        rk.group_advantages(**{k: v for k, v in kw.items() if v is not None})


def test_all_meta_inputs_give_meta_outputs_without_reading_values():
    # Value checks are skipped for meta tensors (no .item()), shapes still follow the contract.
    B, L = 6, 4
    meta = dict(device="meta")
    for kw in (
        dict(
            group_index=torch.zeros(B, dtype=torch.long, **meta), num_groups=3, response_mask=torch.ones(B, L, **meta)
        ),
        dict(
            group_size=2, cu_seqlens=torch.zeros(B + 1, dtype=torch.long, **meta), response_mask=torch.ones(9, **meta)
        ),
        dict(group_size=3, sample_mask=torch.ones(B, dtype=torch.bool, **meta), lengths=torch.ones(B, **meta)),
    ):
        for est in ("grpo", "gdpo", "opo", "reinforce_pp_baseline"):
            if est == "opo" and "lengths" not in kw and "response_mask" not in kw:
                continue
            out = rk.group_advantages(torch.zeros(B, **meta), estimator=est, **kw)
            assert out.advantages.device.type == "meta" and out.advantages.shape == (B,)
            assert out.group_count.shape == (kw.get("num_groups", B // kw.get("group_size", 1)),)
            if "response_mask" in kw:
                assert out.token_advantages.shape == kw["response_mask"].shape
