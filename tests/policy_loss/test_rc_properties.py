"""RolloutCorrection (rlvr_kernels/options.py) on random options and tiny random batches:
the fast backends against the fp64 reference (loss, gradient, metrics; the tolerance
rule), and the degenerate batches (empty, all masked, all rejected) give zeros, never NaN.

Drawn: the IS level (token | sequence) with its thresholds, mode and batch
normalisation; verl's rejection chain (token_k*, seq_sum_k*, seq_mean_k*, seq_max_k*,
comma chained, one threshold per option or one shared); the geometric-mean sequence mask;
OpenRLHF's is_mode clamp | gate with is_gate ratio | binary_kl | tv; log_ratio old |
current. Triton draws from the modes it fuses (it refuses clamp / gate)."""

import math

import pytest
import torch
from _backends import FAST, INTERPRETED
from hypothesis import given
from hypothesis import strategies as st

from rlvr_kernels import RolloutCorrection
from rlvr_kernels.options import IS_GATES, IS_MODES, RS_OPTIONS
from rlvr_kernels.testing import random_policy_case, run_policy_loss
from rlvr_kernels.testing.policy_loss import assert_matches_reference

CPU = [p for p in FAST if p.values[0] == "cpu"]
TRITON = [p for p in FAST if p.values[0] == "triton"]

# IS bounds: among random_policy_case's kinks (its log-ratios keep away from them, so that
# fp32 and fp64 take the same branch at a bound).
UPPERS = (1.2, 2.0, 3.0)
LOWERS = (0.5, 0.8)
# Divergence bounds of is_gate binary_kl / tv (the statistic is a few 1e-3 to 1e-1 here).
DIV_UPPERS = (0.005, 0.02, 0.1)
# One threshold per rejection option, as verl parses them: k1 "lower_upper" or an upper u
# (lower 1/u); the others an upper bound.
RS_THRESHOLDS = {
    "k1": ("0.5_2.0", "1.5", "0.8_1.25"),
    "token_k2": (0.01, 0.05, 0.5),
    "token_k3": (0.01, 0.05, 0.5),
    "seq_sum": (0.1, 0.4, 2.0),
    "seq_mean": (0.01, 0.05, 0.3),
    "seq_max": (0.05, 0.3, 1.0),
}


def _rs_threshold_choices(opt):
    if opt.endswith("k1"):
        return RS_THRESHOLDS["k1"]
    return RS_THRESHOLDS[opt if opt.startswith("token") else opt.rsplit("_", 1)[0]]


@st.composite
def corrections(draw, modes=IS_MODES):
    """A valid RolloutCorrection with IS (any level and mode in ``modes``) or rejection or both."""
    level = draw(st.sampled_from([None, "token", "sequence"]))
    kw = dict(is_level=level)
    if level is not None:
        mode = draw(st.sampled_from([m for m in modes if not (level == "sequence" and m in ("decoupled", "clamp"))]))
        gate = draw(st.sampled_from(IS_GATES)) if mode == "gate" else "ratio"
        high = draw(st.sampled_from(DIV_UPPERS if gate != "ratio" else UPPERS))
        if mode == "icepop":
            low = draw(st.sampled_from(LOWERS))
        elif mode == "mask":
            low = draw(st.sampled_from((None,) + LOWERS))
        elif mode == "clamp":
            low = draw(st.sampled_from((None, 0.0, *LOWERS)))
        elif mode == "gate":
            # any lower bound of a divergence (<= 0: none); a ratio's among the kinks
            low = draw(st.sampled_from((None, -1.0, 0.001) if gate != "ratio" else (None, *LOWERS)))
        else:
            low = None
        norm = mode not in ("clamp", "gate") and draw(st.booleans())
        kw.update(is_threshold=high, is_threshold_low=low, is_mode=mode, is_gate=gate, is_batch_normalize=norm)
    chain = draw(st.lists(st.sampled_from(RS_OPTIONS), max_size=3, unique=True))
    if chain:
        if draw(st.booleans()):
            thr = ",".join(str(draw(st.sampled_from(_rs_threshold_choices(o)))) for o in chain)
        else:  # one threshold shared by the chain (a k1 option reads it as its upper u, so u >= 1)
            thr = draw(st.sampled_from((1.5, 2.0) if any(o.endswith("k1") for o in chain) else (0.05, 0.3, 1.5)))
        kw.update(rs=",".join(chain), rs_threshold=thr)
    if draw(st.booleans()):
        kw["geo_mean"] = draw(st.sampled_from([(0.8, 1.25), (0.95, 1.05)]))
    kw["log_ratio"] = draw(st.sampled_from(["old", "current"]))
    if level is None and not chain and "geo_mean" not in kw:
        kw.update(rs="token_k2", rs_threshold=0.05)
    return RolloutCorrection(**kw)


LOSSES = st.fixed_dictionaries(
    {
        "loss_type": st.sampled_from(["ppo", "reinforce"]),
        "agg": st.sampled_from(["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "none"]),
    }
)
SHAPES = dict(
    layout=st.sampled_from(["padded", "packed"]),
    B=st.integers(0, 5),
    L=st.integers(1, 7),
    # sequences without a valid token (4 >= most B: none has one)
    masked_rows=st.sampled_from([0, 0, 1, 1, 4]),
    seed=st.integers(0, 2**31 - 1),
)


def _check(backend, device, rc, loss, layout, B, L, masked_rows, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = random_policy_case(gen, B=B, L=L, layout=layout, masked_rows=masked_rows, device=device)
    out = assert_matches_reference(inputs, dict(loss, rollout_correction=rc), backend, gen)
    for k, v in out.items():
        assert bool(torch.isfinite(torch.as_tensor(v)).all()), (k, v)


@pytest.mark.parametrize("backend,device", CPU)
@given(rc=corrections(), loss=LOSSES, **SHAPES)
def test_cpu_matches_reference(backend, device, rc, loss, layout, B, L, masked_rows, seed):
    _check(backend, device, rc, loss, layout, B, L, masked_rows, seed)


@pytest.mark.parametrize("backend,device", TRITON)
@given(rc=corrections(), loss=LOSSES, **SHAPES)
def test_triton_matches_reference(backend, device, rc, loss, layout, B, L, masked_rows, seed):
    if INTERPRETED and seed % 4:
        return  # a quarter of the examples under the interpreter (a second per call)
    _check(backend, device, rc, loss, layout, B, L, masked_rows, seed)


# Degenerate batches: no sequence, no valid token, every token rejected.
RC = RolloutCorrection
# (correction, aggregation): each rejects every token of a random batch.
DEGENERATE = [
    (RC("token", 2.0, rs="token_k2", rs_threshold=1e-30), "token-mean"),
    (
        RC("sequence", 2.0, 0.5, "icepop", rs="seq_max_k3,token_k1", rs_threshold="1e-30,1_1", is_batch_normalize=True),
        "seq-mean-token-mean",
    ),
    (RC("token", 2.0, 0.5, "clamp", rs="seq_sum_k2", rs_threshold=1e-30), "seq-mean-token-sum"),
    (RC("sequence", 0.02, is_mode="gate", is_gate="tv", geo_mean=(1.0, 1.0)), "token-mean"),
]


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("batch", ["empty", "all masked", "all rejected"])
@pytest.mark.parametrize("rc,agg", DEGENERATE, ids=["token", "seq icepop", "clamp", "seq gate tv"])
def test_degenerate_batches_give_zeros(backend, device, batch, rc, agg):
    if backend == "triton" and rc.mode in ("clamp", "gate"):
        rc = RC("token", 2.0, rs="seq_mean_k3", rs_threshold=1e-30)  # (the modes Triton fuses)
    gen = torch.Generator().manual_seed(5)
    B = 0 if batch == "empty" else 3
    inputs = random_policy_case(gen, B=B, L=4, masked_rows=B if batch == "all masked" else 0, device=device)
    out = run_policy_loss(inputs, dict(agg=agg, rollout_correction=rc), backend)
    assert float(out["loss"]) == 0.0
    assert out["grad.logprobs"].abs().sum().item() == 0.0
    for k, v in out.items():
        assert math.isfinite(float(torch.as_tensor(v).abs().sum())), k
    assert float(out["metric.num_tokens"]) == 0.0
    if batch == "all rejected":
        assert float(out["metric.rs_masked_frac"]) == 1.0
        assert float(out["metric.rs_seq_masked_frac"]) == 1.0
    else:
        assert float(out["metric.rs_masked_frac"]) == 0.0
