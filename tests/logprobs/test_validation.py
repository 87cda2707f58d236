"""Bad input to ``linear_logprobs`` / ``logprobs_from_logits`` raises a clear
ValueError/TypeError naming the argument, before any kernel runs."""

import pytest
import torch

import rlvr_kernels as rk

H, V, N = 8, 11, 5


def args(**over):
    kw = dict(hidden=torch.randn(N, H), weight=torch.randn(V, H), targets=torch.randint(0, V, (N,)))
    kw.update(over)
    return kw


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(
    "over,exc,match",
    [
        (
            dict(targets=torch.tensor([0, 1, V, 2, 3])),
            ValueError,
            r"targets: expected ids in \[0, 11\).*got 11 at position 2",
        ),
        (dict(targets=torch.tensor([0, -1, 2, 2, 3])), ValueError, r"targets: .*got -1 at position 1"),
        (dict(targets=torch.zeros(N)), TypeError, "targets: expected dtype"),
        (dict(targets=torch.zeros(N + 1, dtype=torch.int64)), ValueError, r"targets: expected shape \(5,\)"),
        (dict(weight=torch.randn(V, H + 1)), ValueError, r"weight: expected shape \(V, 8\)"),
        (dict(weight=torch.randn(V, H, dtype=torch.float64)), TypeError, "weight: expected dtype torch.float32"),
        (dict(weight=torch.randn(0, H)), ValueError, "weight: expected at least one vocabulary row"),
        (dict(hidden=torch.randn(N, H, 1)), ValueError, "hidden: expected a 2-D tensor"),
        (dict(hidden=torch.randint(0, 3, (N, H))), TypeError, "hidden: expected dtype"),
        (dict(bias=torch.randn(V + 1)), ValueError, r"bias: expected shape \(11,\)"),
        (dict(bias=torch.randn(V, dtype=torch.float64)), TypeError, "bias: expected dtype"),
        (dict(temperature=0.0), ValueError, "temperature: expected a finite value > 0"),
        (dict(temperature=-1.0), ValueError, "temperature: expected a finite value > 0"),
        (dict(temperature=float("nan")), ValueError, "temperature: expected a finite value > 0"),
        (dict(temperature="hot"), TypeError, "temperature: expected a float or a tensor"),
        (
            dict(temperature=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])),
            ValueError,
            "temperature: expected finite values > 0",
        ),
        (dict(temperature=torch.ones(N + 1)), ValueError, "temperature: expected a float or a tensor broadcastable"),
        (dict(row_index=torch.tensor([0, 1, 5, 2, 3])), ValueError, r"row_index: expected rows in \[0, 5\)"),
        (dict(row_index=torch.tensor([0, 1, 2])), ValueError, r"row_index: expected shape \(5,\)"),
        (dict(row_index=torch.zeros(N)), TypeError, "row_index: expected dtype"),
        (dict(ignore_index=1.5), TypeError, "ignore_index: expected an int"),
    ],
)
def test_linear_logprobs_errors(backend, over, exc, match):
    with pytest.raises(exc, match=match):
        rk.linear_logprobs(**args(**over), backend=backend)


def test_ignore_index_is_exempt_from_the_range_check():
    t = torch.tensor([0, -100, 3, -100, 4])
    logp = rk.linear_logprobs(**args(targets=t), backend="cpu")
    assert bool((logp[t == -100] == 0).all())
    logp = rk.linear_logprobs(**args(targets=torch.tensor([0, 7, 3, 7, 4])), ignore_index=7, backend="cpu")
    assert float(logp[1]) == 0.0 and float(logp[0]) < 0


def test_validate_false_skips_value_checks_but_stays_in_bounds():
    """Out-of-range ids with validate=False: no error, no out-of-bounds access (the
    sanitizer run checks the latter); such a target matches no column."""
    kw = args(targets=torch.tensor([0, V + 5, -7, 2, 3]), row_index=torch.tensor([0, 1, 2, 2, 4]))
    logp = rk.linear_logprobs(**kw, validate=False, backend="cpu")
    assert logp.shape == (N,) and bool(torch.isfinite(logp[[0, 3, 4]]).all())


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (
            lambda: rk.logprobs_from_logits(torch.randn(4, V), torch.zeros(5, dtype=torch.int64)),
            ValueError,
            r"targets: expected shape \(4,\)",
        ),
        (lambda: rk.logprobs_from_logits(torch.randn(4, V), torch.full((4,), V)), ValueError, "targets: expected ids"),
        (
            lambda: rk.logprobs_from_logits(torch.randn(4, V).long(), torch.zeros(4, dtype=torch.int64)),
            TypeError,
            "logits: expected dtype",
        ),
        (
            lambda: rk.logprobs_from_logits(torch.randn(4, 0), torch.zeros(4, dtype=torch.int64)),
            ValueError,
            "logits: expected a vocabulary of at least 1",
        ),
        (
            lambda: rk.logprobs_from_logits(torch.randn(4, V), torch.zeros(4, dtype=torch.int64), 0.0),
            ValueError,
            "temperature",
        ),
        (
            lambda: rk.logprobs_from_logits(torch.randn(4, V), torch.zeros(4, dtype=torch.int64), backend="gpu"),
            ValueError,
            "backend: expected one of",
        ),
        (
            lambda: rk.linear_logprobs(**args(), process_group=object(), backend="reference"),
            ValueError,
            "process_group: the reference backend is single-process",
        ),
    ],
)
def test_other_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
