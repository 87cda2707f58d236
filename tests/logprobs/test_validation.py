"""Bad input to ``linear_logprobs`` / ``logprobs_from_logits`` raises a clear
ValueError/TypeError naming the argument, before any kernel runs."""

import pytest
import torch

import rlvr_kernels as rk

H, V, N = 8, 11, 5
TEMP_RANGE = r"temperature: expected a finite number in \[1e-30, 1e\+30\]"
TEMP_VALUES = r"temperature: expected values in \[1e-30, 1e\+30\]"


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
        (dict(temperature=0.0), ValueError, TEMP_RANGE + ", got 0.0"),
        (dict(temperature=-1.0), ValueError, TEMP_RANGE + ", got -1.0"),
        (dict(temperature=float("nan")), ValueError, TEMP_RANGE + ", got nan"),
        (dict(temperature=float("inf")), ValueError, TEMP_RANGE + ", got inf"),
        # Below 1/FLT_MAX, 1/T overflows fp32; the range keeps headroom for the logits.
        (dict(temperature=1e-39), ValueError, TEMP_RANGE + ", got 1e-39"),
        (dict(temperature=1e-31), ValueError, TEMP_RANGE),
        (dict(temperature=1e31), ValueError, TEMP_RANGE),
        (dict(temperature="hot"), TypeError, "temperature: expected a float or a tensor"),
        (dict(temperature=True), TypeError, "temperature: expected a float or a tensor"),
        (
            dict(temperature=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])),
            ValueError,
            TEMP_VALUES + r", got 0.0 at \(1,\)",
        ),
        (dict(temperature=torch.full((N,), 1e-40)), ValueError, TEMP_VALUES + r", got 9\.99\d*e-41 at \(0,\)"),
        (dict(temperature=torch.tensor(float("nan"))), ValueError, TEMP_VALUES + ", got nan"),
        # A tensor's bounds are the range's ends as its dtype rounds them, no further.
        (dict(temperature=torch.full((N,), 1.001e30)), ValueError, TEMP_VALUES + r", got 1\.00\d*e\+30 at \(0,\)"),
        (dict(temperature=torch.full((N,), 0.999e-30)), ValueError, TEMP_VALUES + r", got 9\.98\d*e-31 at \(0,\)"),
        (dict(temperature=torch.ones(N).long()), TypeError, "temperature: expected dtype"),
        (
            dict(temperature=torch.ones(N, device="meta")),
            ValueError,
            r"temperature: expected a tensor on cpu \(where hidden lives\), got meta",
        ),
        (dict(temperature=torch.ones(N + 1)), ValueError, "temperature: expected a float or a tensor broadcastable"),
        (dict(row_index=torch.tensor([0, 1, 5, 2, 3])), ValueError, r"row_index: expected rows in \[0, 5\)"),
        (dict(row_index=torch.tensor([0, 1, 2])), ValueError, r"row_index: expected shape \(5,\)"),
        (dict(row_index=torch.zeros(N)), TypeError, "row_index: expected dtype"),
        (dict(ignore_index=1.5), TypeError, "ignore_index: expected an int"),
        (dict(ignore_index=2**70), ValueError, "ignore_index: expected an int <= "),
        (dict(weight=torch.randn(V, H, device="meta")), ValueError, r"weight: expected a tensor on cpu"),
        (
            dict(targets=torch.zeros(N, dtype=torch.long, device="meta")),
            ValueError,
            "targets: expected a tensor on cpu",
        ),
    ],
)
def test_linear_logprobs_errors(backend, over, exc, match):
    with pytest.raises(exc, match=match):
        rk.linear_logprobs(**args(**over), backend=backend)


def test_ignore_index_is_exempt_from_the_range_check():
    t = torch.tensor([0, -100, 3, -100, 4])
    logp = rk.linear_logprobs(**args(targets=t), backend="cpu").logp
    assert bool((logp[t == -100] == 0).all())
    logp = rk.linear_logprobs(**args(targets=torch.tensor([0, 7, 3, 7, 4])), ignore_index=7, backend="cpu").logp
    assert float(logp[1]) == 0.0 and float(logp[0]) < 0


def test_validate_false_skips_value_checks_but_stays_in_bounds():
    """Out-of-range ids with validate=False: no error, no out-of-bounds access (the
    sanitizer run checks the latter); such a target matches no column."""
    kw = args(targets=torch.tensor([0, V + 5, -7, 2, 3]), row_index=torch.tensor([0, 1, 2, 2, 4]))
    logp = rk.linear_logprobs(**kw, validate=False, backend="cpu").logp
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
            TEMP_RANGE,
        ),
        (
            lambda: rk.logprobs_from_logits(
                torch.randn(4, V), torch.zeros(4, dtype=torch.int64), torch.full((4,), 1e-40)
            ),
            ValueError,
            TEMP_VALUES,
        ),
        (
            # The logits' error names the logits (it used to say "hidden" for 2-D logits).
            lambda: rk.logprobs_from_logits(
                torch.randn(4, V), torch.zeros(4, dtype=torch.int64), torch.ones(4, device="meta")
            ),
            ValueError,
            r"temperature: expected a tensor on cpu \(where logits lives\), got meta",
        ),
        (
            lambda: rk.logprobs_from_logits(torch.randn(4, V), torch.zeros(4, dtype=torch.int64, device="meta")),
            ValueError,
            r"targets: expected a tensor on cpu \(where logits lives\)",
        ),
        (
            lambda: rk.logprobs_from_logits(torch.randn(4, V), torch.zeros(4, dtype=torch.int64), torch.ones(3)),
            ValueError,
            r"temperature: expected a float or a tensor broadcastable to \(4,\)",
        ),
        (
            lambda: rk.logprobs_from_logits(torch.randn(4, V), torch.zeros(4, dtype=torch.int64), ignore_index="x"),
            TypeError,
            "ignore_index: expected an int",
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


# ------------------------------------------------------------------ sizes the kernels cannot index
# Expanded and meta tensors claim any size without memory: such a size is refused up front,
# naming the argument, not by an allocation inside a kernel.
BIG = 2**40


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: rk.logprobs_from_logits(
                torch.randn(1, V).expand(BIG, V), torch.zeros(1, dtype=torch.long).expand(BIG)
            ),
            r"logits: expected at most 2147483647 rows \(the product of the leading dimensions\), got 1099511627776",
        ),
        (
            lambda: rk.logprobs_from_logits(
                torch.empty(2**20, 2**20, V, device="meta"), torch.empty(2**20, 2**20, dtype=torch.long, device="meta")
            ),
            "logits: expected at most 2147483647 rows",
        ),
        (
            lambda: rk.logprobs_from_logits(torch.randn(1).expand(BIG), torch.zeros((), dtype=torch.long)),
            "logits: expected at most 2147483647 vocabulary entries",
        ),
        (
            lambda: rk.linear_logprobs(
                torch.randn(1, H).expand(BIG, H), torch.randn(V, H), torch.zeros(1, dtype=torch.long).expand(BIG)
            ),
            "hidden: expected at most 2147483647 rows, got 1099511627776",
        ),
        (
            lambda: rk.linear_logprobs(
                torch.empty(N, H, device="meta"),
                torch.empty(BIG, H, device="meta"),
                torch.zeros(N, device="meta").long(),
            ),
            "weight: expected at most 2147483647 vocabulary rows",
        ),
        (
            lambda: rk.linear_logprobs(
                torch.randn(N, H),
                torch.randn(V, H),
                torch.zeros(1, dtype=torch.long).expand(BIG),
                row_index=torch.zeros(1, dtype=torch.long).expand(BIG),
            ),
            "targets: expected at most 2147483647 targets",
        ),
    ],
)
def test_absurd_sizes_are_refused_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ meta tensors
@pytest.mark.parametrize("entropy", [False, True])
def test_meta_in_meta_out(entropy):
    """All-meta inputs: no value check reads them (no ``.item()``), and the outputs and
    gradients are meta tensors of the right shapes and dtypes."""
    meta = dict(device="meta")
    hidden = torch.empty(N, H, **meta, requires_grad=True)
    weight = torch.empty(V, H, dtype=torch.float32, **meta, requires_grad=True)
    bias = torch.empty(V, **meta, requires_grad=True)
    targets = torch.empty(N + 2, dtype=torch.long, **meta)
    row_index = torch.empty(N + 2, dtype=torch.int32, **meta)
    temp = torch.empty(N, **meta)
    out = rk.linear_logprobs(
        hidden, weight, targets, row_index=row_index, bias=bias, temperature=temp, return_entropy=entropy
    )
    logp, ent = out.logp, out.entropy
    assert (ent is None) == (not entropy)
    assert logp.device.type == "meta" and logp.shape == (N + 2,) and logp.dtype == torch.float32
    loss = logp.sum() + (ent.sum() if entropy else 0)
    if entropy:
        assert ent.shape == (N,) and ent.device.type == "meta"
    loss.backward()
    for leaf in (hidden, weight, bias):
        assert leaf.grad.device.type == "meta" and leaf.grad.shape == leaf.shape

    logits = torch.empty(2, 3, V, dtype=torch.bfloat16, **meta, requires_grad=True)
    lt = torch.empty(2, 3, dtype=torch.long, **meta)
    logp, ent = rk.logprobs_from_logits(logits, lt, torch.empty((), **meta), entropy)
    assert logp.device.type == "meta" and logp.shape == (2, 3) and logp.dtype == torch.float32
    (logp.sum() + (ent.sum() if entropy else 0)).backward()
    assert logits.grad.device.type == "meta" and logits.grad.shape == logits.shape


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_temperature_tensor_broadcasts(backend):
    """A 0-d or [1] temperature tensor is one temperature for every row (it used to fail with
    ``shape '[5]' is invalid``), with the numbers of the same value given per row."""
    kw = args()
    per_row = rk.linear_logprobs(**kw, temperature=torch.full((N,), 0.7), return_entropy=True, backend=backend)
    for t in (torch.tensor(0.7), torch.tensor([0.7])):
        got = rk.linear_logprobs(**kw, temperature=t, return_entropy=True, backend=backend)
        assert torch.equal(got.logp, per_row.logp) and torch.equal(got.entropy, per_row.entropy)
    logits, lt = torch.randn(2, 3, V), torch.randint(0, V, (2, 3))
    want = rk.logprobs_from_logits(logits, lt, torch.full((2, 3), 0.7), backend=backend).logp
    for t in (torch.tensor(0.7), torch.tensor([0.7]), torch.full((2, 1), 0.7)):
        assert torch.equal(rk.logprobs_from_logits(logits, lt, t, backend=backend).logp, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_temperature_tensor_takes_the_range_ends_as_its_dtype_rounds_them(dtype):
    """torch.full(N, 1e30) in fp32 holds 1.0000000150e30, above 1e30 as a float64: accepted,
    as is each dtype's nearest to 1e-30."""
    kw = args()
    for t in (1e-30, 1e30):
        temperature = torch.full((N,), t, dtype=dtype)
        out = rk.linear_logprobs(**kw, temperature=temperature, return_entropy=True, backend="cpu")
        ref = rk.linear_logprobs(**kw, temperature=temperature, return_entropy=True, backend="reference")
        torch.testing.assert_close(out.logp, ref.logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.entropy, ref.entropy, rtol=1e-5, atol=1e-5)


def test_validate_false_skips_temperature_values_only():
    """validate=False skips the checks that read tensor data (a tensor temperature), never the
    static ones (a float temperature)."""
    kw = args()
    out = rk.linear_logprobs(**kw, temperature=torch.full((N,), 1e-40), validate=False, backend="cpu")
    assert out.logp.shape == (N,)
    with pytest.raises(ValueError, match=TEMP_RANGE):
        rk.linear_logprobs(**kw, temperature=1e-39, validate=False, backend="cpu")
