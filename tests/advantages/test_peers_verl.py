"""Our verl drop-ins against verl's own ``verl.trainer.ppo.core_algos`` functions.

Every test draws a fresh random batch (hypothesis draws the sizes and a seed; the tensors
come from a ``torch.Generator`` seeded with it), runs verl's real function and ours on
copies of the same inputs, and requires both outputs (advantages, returns) to agree in
dtype, shape and value to 1e-6 (fp32).

The batches look like verl's: ``token_level_rewards [bs, L]`` with the scalar reward at the
last valid token (a row with no valid token gets it at index -1, as verl's reward managers
write ``reward_tensor[i, valid_response_length - 1]``) or a reward on every valid token;
``response_mask [bs, L]`` with ragged lengths and some empty rows; ``index`` a numpy object
array of uuid strings, groups of 2..16 samples plus singleton groups, shuffled.

Inputs stay in the domain where verl itself works (see ``make_batch``):
  * whitening estimators (REINFORCE++-baseline, GDPO): verl's ``masked_whiten`` raises when
    the mask holds <= 1 token, so every batch has at least 2 valid tokens;
  * OPO: verl divides by the summed lengths of a group, NaN when a group of >= 2 samples
    has no valid token at all, so for OPO every such group gets one valid token;
  * integer-valued rewards spread over tokens use integer token rewards, so their sums
    are exact: verl divides by (std + 1e-6), and a group of equal scores that fp32 rounding
    makes "almost equal" would turn verl's own last-bit rounding noise into O(1) numbers.

verl computes in float32 and ours accumulates in float64, so the reference is verl's own
arithmetic, run twice (see ``check_against_verl``): ours must match verl's formula evaluated
in float64 by verl's code on every example, and verl's real float32 output on every example
where that output is within 2.5e-7 of its float64 one. The exceptions are inputs where
verl's float32 rounding alone exceeds the tolerance: a group of nearly equal scores
divided by (std + 1e-6), or whitening a constant (verl multiplies its rounding error by
rsqrt(0 + 1e-8) = 1e4, and its ``masked_mean`` divides by ``mask.sum() + 1e-8``, a formula
difference from ours bounded in ``whitening_gap``). Hypothesis ``event``s count both paths
(``pytest --hypothesis-show-statistics``).
"""

from __future__ import annotations

import inspect
import random
import uuid
from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from omegaconf import OmegaConf
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

from rlvr_kernels.integrations import verl as ours

ATOL = RTOL = 1e-6
EXAMPLES = 30

NAMES = [
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_gdpo_outcome_advantage",
]


# ---------------------------------------------------------------------------------------
# Random verl batches
# ---------------------------------------------------------------------------------------


@dataclass
class Batch:
    token_level_rewards: torch.Tensor  # [bs, L]
    response_mask: torch.Tensor  # [bs, L]
    index: np.ndarray  # [bs] object array of uuid strings
    group_sizes: list
    seed: int

    def copies(self):
        """Fresh copies of (token_level_rewards, response_mask, index) for one call."""
        return self.token_level_rewards.clone(), self.response_mask.clone(), self.index.copy()


@st.composite
def batch_specs(draw, min_groups=1):
    return dict(
        multi=draw(st.lists(st.integers(2, 16), min_size=min_groups, max_size=6)),
        singletons=draw(st.integers(0, 3)),
        L=draw(st.integers(2, 24)),
        kind=draw(st.sampled_from(["binary", "int", "gaussian"])),
        placement=draw(st.sampled_from(["last", "spread"])),
        p_empty=draw(st.sampled_from([0.0, 0.15, 0.4])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def draw_values(kind, shape, gen):
    if kind == "binary":
        return torch.randint(0, 2, shape, generator=gen).float()
    if kind == "int":
        return torch.randint(-3, 6, shape, generator=gen).float()
    return torch.randn(shape, generator=gen)


def make_batch(spec, *, opo_domain=False, mask_dtype=torch.float32, reward_dtype=torch.float32) -> Batch:
    gen = torch.Generator().manual_seed(spec["seed"])
    rng = random.Random(spec["seed"])
    sizes = list(spec["multi"]) + [1] * spec["singletons"]
    rng.shuffle(sizes)
    uids = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in sizes]
    labels = [u for u, n in zip(uids, sizes) for _ in range(n)]
    bs, L = len(labels), spec["L"]
    perm = torch.randperm(bs, generator=gen).tolist()
    index = np.array([labels[p] for p in perm], dtype=object)

    lengths = torch.randint(1, L + 1, (bs,), generator=gen)
    lengths[torch.rand(bs, generator=gen) < spec["p_empty"]] = 0
    if opo_domain:
        # verl's OPO gives NaN for a group of >= 2 samples with no valid token in total.
        for u, n in zip(uids, sizes):
            rows = np.flatnonzero(index == u)
            if n > 1 and int(lengths[rows].sum()) == 0:
                lengths[rows[0]] = 1
    if int(lengths.sum()) < 2:  # verl's masked_whiten needs >= 2 valid tokens
        lengths[0] = L
    mask = torch.arange(L)[None, :] < lengths[:, None]

    if spec["placement"] == "last":
        r = draw_values(spec["kind"], (bs,), gen)
        tlr = torch.zeros(bs, L)
        # lengths - 1 = -1 for an empty row: verl's reward managers write it at L - 1.
        tlr[torch.arange(bs), lengths - 1] = r
    else:
        per_token = draw_values(spec["kind"], (bs, L), gen)
        if spec["kind"] == "binary":  # sparse 0/1 token rewards
            per_token = per_token * (torch.rand(bs, L, generator=gen) < 0.3)
        elif spec["kind"] == "gaussian":
            per_token = per_token * 0.5
        tlr = per_token * mask
    tlr = tlr.to(reward_dtype)
    return Batch(tlr, mask.to(mask_dtype), index, sizes, spec["seed"])


# ---------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------

# verl's vectorised GRPO keeps its group mean/std in float32 whatever the input dtype, so its
# formula in float64 is evaluated by the loop implementation (same numbers: mean 0 / std 1
# for singletons, torch.std's Bessel correction).
FP64_TWIN = {"compute_grpo_vectorized_outcome_advantage": "compute_grpo_outcome_advantage"}


def verl_call(call, fn):
    """``call(fn)`` with verl's ``masked_whiten`` spied on: returns (output, [(values, mask)])."""
    seen = []
    real = core_algos.verl_F.masked_whiten

    def spy(values, mask, *args, **kw):
        seen.append((values.detach().double(), mask.detach() != 0))
        return real(values, mask, *args, **kw)

    with mock.patch.object(core_algos.verl_F, "masked_whiten", spy):
        return call(fn), seen


def whitening_gap(seen) -> float:
    """Bound on |ours − verl| in exact arithmetic from the one place the formulas differ:
    verl's ``masked_mean`` divides by ``mask.sum() + 1e-8``, ours by ``mask.sum()``. That
    shifts the mean by |m|·1e-8/W, which ``rsqrt(var + 1e-8)`` amplifies by up to 1e4 when
    the whitened values are (nearly) constant; it is ~1e-12 otherwise."""
    if not seen:
        return 0.0
    assert len(seen) == 1, "verl's estimator no longer calls masked_whiten once"
    values, mask = seen[0]
    x = values[mask]
    W = x.numel()
    mean = float(x.mean())
    var = float(x.var()) if W > 1 else 0.0
    return 2.0 * abs(mean) * 1e-8 / W / (var + 1e-8) ** 0.5


def check_against_verl(name, batch: Batch, kwargs=None, *, call=None, exact=None):
    """Run verl's ``name`` (float32, as verl runs) and ours on copies of the same inputs and
    compare them. The reference is verl's own arithmetic, so the comparison has two parts:

    * ours vs verl's formula evaluated in float64 by verl's code (``exact``), always, to
      1e-6 (plus ``whitening_gap``, which only matters for a constant whitening input);
    * ours vs verl's float32 output to 1e-6, whenever that output is itself within 2.5e-7
      of verl's float64 one. Otherwise verl's float32 rounding is above the tolerance on
      its own (a group whose scores nearly coincide, divided by std + 1e-6; a constant
      whitening input, multiplied by rsqrt(0 + 1e-8) = 1e4), and the float64 run is the
      only meaningful reference.
    """
    kwargs = kwargs or {}
    if call is None:

        def call(fn, tlr, mask, index):
            return fn(tlr, mask, index, **kwargs)

    if exact is None:

        def exact():
            tlr, mask, index = batch.copies()
            fn = getattr(core_algos, FP64_TWIN.get(name, name))
            return verl_call(lambda f: call(f, tlr.double(), mask.double(), index), fn)

    theirs, _ = verl_call(lambda f: call(f, *batch.copies()), getattr(core_algos, name))
    reference, seen = exact()
    tlr, mask, index = batch.copies()
    mine = call(getattr(ours, name), tlr, mask, index)
    # Ours leaves its inputs alone.
    assert torch.equal(tlr, batch.token_level_rewards) and torch.equal(mask, batch.response_mask)
    assert (index == batch.index).all()

    gap = whitening_gap(seen)
    assert isinstance(mine, tuple) and len(mine) == 2, type(mine)
    strict = True
    for what, a, b, e in zip(("advantages", "returns"), mine, theirs, reference):
        assert torch.isfinite(b).all() and torch.isfinite(e).all(), f"verl: non-finite {what}, outside its domain"
        assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != verl's {b.dtype}"
        assert a.shape == b.shape == batch.response_mask.shape, f"{what}: shape {a.shape} != verl's {b.shape}"
        assert a.device == b.device
        assert (a[batch.response_mask == 0] == 0).all(), f"{what}: nonzero outside the response"
        e = e.to(b.dtype)
        where = f"(seed={batch.seed}, sizes={batch.group_sizes}, kwargs={kwargs})"
        torch.testing.assert_close(
            a,
            e,
            atol=ATOL + gap,
            rtol=RTOL,
            msg=lambda m: f"{what} differ from verl's formula in float64 {where}:\n{m}",
        )
        if gap <= 1e-7 and torch.allclose(b, e, atol=ATOL / 4, rtol=RTOL / 4):
            torch.testing.assert_close(
                a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} differ from verl {where}:\n{m}"
            )
        else:
            strict = False
    if currently_in_test_context():
        event("compared with verl's float32 output" if strict else "verl's float32 rounding above 2.5e-7: float64 only")
    return strict


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_signatures_match_verl(name):
    """Same parameter names, kinds and defaults as verl's function (a true drop-in)."""
    want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(core_algos, name)).parameters.values()]
    got = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(ours, name)).parameters.values()]
    assert got == want
    assert set(NAMES) <= set(ours.__all__)  # (the policy-loss drop-ins: tests/policy_loss/test_peers_verl.py)


EPSILONS = st.sampled_from([None, 1e-8, 1e-4, 0.1, 1.0])


@pytest.mark.parametrize("name", ["compute_grpo_outcome_advantage", "compute_grpo_vectorized_outcome_advantage"])
@settings(max_examples=EXAMPLES)
@given(spec=batch_specs(), norm=st.booleans(), epsilon=EPSILONS, pass_config=st.booleans())
def test_grpo_matches_verl(name, spec, norm, epsilon, pass_config):
    """GRPO (norm_adv_by_std_in_grpo=True) and Dr.GRPO (False), default and custom epsilon,
    loop and vectorised verl implementations (singletons: mean 0, std 1)."""
    batch = make_batch(spec)
    kwargs = dict(norm_adv_by_std_in_grpo=norm)
    if epsilon is not None:
        kwargs["epsilon"] = epsilon
    if pass_config:
        kwargs["config"] = AlgoConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm)
    check_against_verl(name, batch, kwargs)


@pytest.mark.parametrize("name", ["compute_rloo_outcome_advantage", "compute_rloo_vectorized_outcome_advantage"])
@settings(max_examples=EXAMPLES)
@given(spec=batch_specs(), epsilon=EPSILONS)
def test_rloo_matches_verl(name, spec, epsilon):
    """RLOO, loop (singleton keeps its raw score) and vectorised (singleton gets 0)."""
    batch = make_batch(spec)
    kwargs = {} if epsilon is None else dict(epsilon=epsilon)
    check_against_verl(name, batch, kwargs)


@settings(max_examples=EXAMPLES)
@given(spec=batch_specs())
def test_opo_matches_verl(spec):
    """OPO: length-weighted baseline with ragged (and empty) responses."""
    batch = make_batch(spec, opo_domain=True)
    check_against_verl("compute_opo_outcome_advantage", batch)


@settings(max_examples=EXAMPLES)
@given(
    spec=batch_specs(),
    f_norm=st.one_of(st.just(None), st.sampled_from([1.0, 0.5, 2.0]), st.floats(0.1, 10.0)),
    alpha=st.one_of(st.just(None), st.floats(0.1, 5.0)),
)
def test_gpg_matches_verl(spec, f_norm, alpha):
    """GPG with default and custom f_norm; verl recomputes alpha = bs / #nonzero and
    ignores the argument, so any alpha passed must change nothing."""
    batch = make_batch(spec)
    kwargs = {}
    if f_norm is not None:
        kwargs["f_norm"] = f_norm
    if alpha is not None:
        kwargs["alpha"] = alpha
    check_against_verl("compute_gpg_outcome_advantage", batch, kwargs)


@settings(max_examples=EXAMPLES)
@given(spec=batch_specs())
def test_reinforce_plus_plus_baseline_matches_verl(spec):
    """REINFORCE++-baseline: r − group mean, whitened over all valid tokens."""
    batch = make_batch(spec)
    check_against_verl("compute_reinforce_plus_plus_baseline_outcome_advantage", batch)


@settings(max_examples=EXAMPLES)
@given(spec=batch_specs(), norm=st.booleans(), epsilon=EPSILONS, config_kind=st.sampled_from(["none", "algo", "dict"]))
def test_gdpo_fallback_matches_verl(spec, norm, epsilon, config_kind):
    """GDPO without per-key rewards: token_level_rewards is the only term (verl's fallback,
    taken when config, non_tensor_batch or batch is missing)."""
    batch = make_batch(spec)
    kwargs = dict(norm_adv_by_std_in_grpo=norm)
    if epsilon is not None:
        kwargs["epsilon"] = epsilon
    if config_kind == "algo":
        kwargs["config"] = AlgoConfig(adv_estimator="gdpo", gdpo_reward_keys=["acc"])
    elif config_kind == "dict":
        kwargs["config"] = {"gdpo_reward_keys": ["acc"]}
    check_against_verl("compute_gdpo_outcome_advantage", batch, kwargs)


def _key_scores(kind, bs, gen, container):
    values = draw_values(kind, (bs,), gen).numpy().astype(np.float64)
    if container == "float64":
        return values
    if container == "float32":
        return values.astype(np.float32)
    if container == "object":  # DataProto's collate_fn / concat keep dtype=object arrays
        return np.array([float(v) for v in values], dtype=object)
    return [float(v) for v in values]  # a list


@settings(max_examples=EXAMPLES)
@given(
    spec=batch_specs(),
    num_keys=st.integers(1, 3),
    key_kinds=st.lists(st.sampled_from(["binary", "int", "gaussian"]), min_size=3, max_size=3),
    weights=st.one_of(st.just(None), st.lists(st.floats(-2.0, 3.0, width=32), min_size=3, max_size=3)),
    norm=st.booleans(),
    epsilon=EPSILONS,
    config_kind=st.sampled_from(["algo", "omegaconf", "dict"]),
    container=st.sampled_from(["float64", "float32", "object", "list"]),
    prompt_len=st.integers(1, 8),
)
def test_gdpo_multi_key_matches_verl(
    spec, num_keys, key_kinds, weights, norm, epsilon, config_kind, container, prompt_len
):
    """GDPO with several reward terms read from non_tensor_batch[key] (config.gdpo_reward_keys,
    optional config.gdpo_reward_weights), each normalised per group, weighted, whitened."""
    batch = make_batch(spec)
    bs, L = batch.response_mask.shape
    gen = torch.Generator().manual_seed(spec["seed"] ^ 0x5EED)
    keys = [f"reward_{k}" for k in range(num_keys)]
    non_tensor_batch = {"uid": batch.index.copy(), "data_source": np.array(["x"] * bs, dtype=object)}
    for k, kind in zip(keys, key_kinds):
        non_tensor_batch[k] = _key_scores(kind, bs, gen, container)

    # batch["attention_mask"] = [prompt mask | response mask], consistent with response_mask
    # (left-padded prompts); verl reads the response lengths from it.
    prompt_mask = (torch.arange(prompt_len)[None, :] >= torch.randint(0, prompt_len, (bs, 1), generator=gen)).long()
    attention_mask = torch.cat([prompt_mask, batch.response_mask.long()], dim=1)
    tensors = {
        "prompts": torch.randint(3, 1000, (bs, prompt_len), generator=gen) * prompt_mask,
        "attention_mask": attention_mask,
        "responses": torch.randint(3, 1000, (bs, L), generator=gen),
        "response_mask": batch.response_mask.clone(),
    }
    cfg = {"gdpo_reward_keys": keys}
    if weights is not None:
        cfg["gdpo_reward_weights"] = weights[:num_keys]
    if config_kind == "algo":
        config = AlgoConfig(adv_estimator="gdpo", **cfg)
    elif config_kind == "omegaconf":
        config = OmegaConf.create({"adv_estimator": "gdpo", "norm_adv_by_std_in_grpo": norm, **cfg})
    else:
        config = cfg

    kwargs = dict(norm_adv_by_std_in_grpo=norm, config=config)
    if epsilon is not None:
        kwargs["epsilon"] = epsilon

    def call(fn, tlr, mask, index):
        ntb = {k: (v.copy() if isinstance(v, np.ndarray) else list(v)) for k, v in non_tensor_batch.items()}
        tb = {k: v.clone() for k, v in tensors.items()}
        return fn(tlr, mask, index, non_tensor_batch=ntb, batch=tb, **kwargs)

    def exact():
        """verl's GDPO in float64, assembled from verl's own pieces exactly as its source
        does (its per-key path builds float32 score tensors whatever the input dtype)."""
        mask = batch.response_mask.double()
        last = tensors["attention_mask"][:, prompt_len:].sum(dim=1) - 1
        w = cfg.get("gdpo_reward_weights") or [1.0] * num_keys
        w = torch.tensor(list(w), dtype=torch.float32).double()
        total = torch.zeros_like(mask)
        for k, key in enumerate(keys):
            scores = torch.zeros_like(mask)
            scores[torch.arange(bs), last] = torch.from_numpy(
                np.asarray(non_tensor_batch[key], dtype=np.float32)
            ).double()
            term, _ = core_algos.compute_grpo_outcome_advantage(
                scores, mask, batch.index.copy(), epsilon=kwargs.get("epsilon", 1e-6), norm_adv_by_std_in_grpo=norm
            )
            total = total + w[k] * term
        adv, seen = verl_call(lambda _: core_algos.verl_F.masked_whiten(total, mask) * mask, None)
        return (adv, adv), seen

    check_against_verl("compute_gdpo_outcome_advantage", batch, call=call, exact=exact)


@pytest.mark.parametrize("reward_dtype", [torch.float32, torch.float64], ids=["tlr_fp32", "tlr_fp64"])
@pytest.mark.parametrize(
    "mask_dtype", [torch.float32, torch.float64, torch.int64, torch.bool], ids=["fp32", "fp64", "int64", "bool"]
)
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=5)
@given(spec=batch_specs())
def test_dtypes_match_verl(name, mask_dtype, reward_dtype, spec):
    """Output dtype follows verl's (scores · response_mask type promotion) for fp32/fp64
    rewards and float, int64 (verl's attention-mask slice) and bool response masks."""
    batch = make_batch(spec, opo_domain=True, mask_dtype=mask_dtype, reward_dtype=reward_dtype)
    check_against_verl(name, batch)


@pytest.mark.parametrize(
    "name", ["compute_gdpo_outcome_advantage", "compute_reinforce_plus_plus_baseline_outcome_advantage"]
)
def test_whitening_a_constant(name):
    """The whitening exception, pinned. One group, scores [0, 0, 1], the third response
    empty: Dr.GRPO / r − mean give c = −1/3 to both samples with tokens (W = 10 tokens), so
    verl whitens a constant. Exactly, verl's formula gives c·1e-8/W · rsqrt(1e-8) =
    c·1e-4/W = −3.3e-6 (its masked_mean divides by W + 1e-8); in float32 it returns its
    rounding error of the mean × 1e4 (−3e-4 here); ours returns 0."""
    tlr = torch.zeros(3, 8)
    tlr[2, 7] = 1.0
    mask = torch.zeros(3, 8)
    mask[0, :3] = 1
    mask[1, :7] = 1
    index = np.array(["a", "a", "a"], dtype=object)
    kwargs = dict(norm_adv_by_std_in_grpo=False) if name == "compute_gdpo_outcome_advantage" else {}
    mine, _ = getattr(ours, name)(tlr.clone(), mask.clone(), index, **kwargs)
    assert torch.equal(mine, torch.zeros(3, 8))
    exact, _ = getattr(core_algos, name)(tlr.double(), mask.double(), index, **kwargs)
    c, W = -1 / 3, 10
    torch.testing.assert_close(exact, c * 1e-4 / W * mask.double(), atol=1e-12, rtol=1e-6)
    theirs, _ = getattr(core_algos, name)(tlr.clone(), mask.clone(), index, **kwargs)
    assert theirs.abs().max() <= 16 * torch.finfo(torch.float32).eps * abs(c) * 1e4  # rounding noise
    assert not check_against_verl(name, Batch(tlr, mask, index, [3], seed=-1), kwargs)  # the float64 path
