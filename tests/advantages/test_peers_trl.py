"""Our TRL drop-ins against TRL's own advantage code.

TRL computes advantages inline (no function to call), so the tests take TRL's real source
at test time: ``inspect.getsource`` of ``GRPOTrainer._generate_and_score_completions`` and
of the async rollout worker, cut at fixed marker lines, dedented and ``exec``'d in a
namespace holding exactly the names the block reads. If TRL moves or rewrites a block the
markers stop matching and the tests fail (they never skip), naming the TRL version.

Inputs: ``rewards_per_func [B, n_funcs]`` float32 as TRL builds it, B = num_prompts ·
num_generations in contiguous groups, NaN where a reward function returned None, with
rows (and whole groups) where every function is NaN.

TRL computes in float32 and ours accumulates in float64, so the reference is TRL's own
code run twice: ours must match TRL's block evaluated in float64 on every example, and
TRL's real float32 output on every example where that output is within 2.5e-7 of the
float64 one. The exceptions are inputs where TRL's float32 rounding alone exceeds the
tolerance, because TRL divides by (std + 1e-4): a group of equal rewards whose float32 sum
is inexact (3 × 2.8425727 from non-dyadic weights: ``torch.nanmean`` misses by an ulp and
TRL returns ulp × 1e4 ≈ 2e-3 instead of 0, pinned in
``test_degenerate_group_with_inexact_weights``), or normalised terms that nearly cancel
before ``normalize_then_sum``'s batch whitening. Hypothesis ``event``s count both paths
(``pytest --hypothesis-show-statistics``). The async worker already works in float64, so
that comparison is always strict.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import types

import numpy as np
import pytest
import torch
import trl
from hypothesis import event, given, settings
from hypothesis import strategies as st
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from rlvr_kernels.integrations.trl import compute_async_grpo_advantages, compute_grpo_advantages

ATOL = RTOL = 1e-6
EXAMPLES = 30

SYNC_START = "unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)"
SYNC_END = "advantages = torch.nan_to_num(advantages, nan=0.0)"
ASYNC_START = "arr = np.array(all_rewards, dtype=float)"
ASYNC_END = "advantages[scored_mask] = "


def _cut(source: str, start: str, end: str, where: str) -> str:
    lines = source.splitlines()
    first = [i for i, line in enumerate(lines) if start in line]
    if len(first) != 1:
        pytest.fail(
            f"TRL {trl.__version__}: expected exactly one line containing {start!r} in {where}, "
            f"found {len(first)}; TRL's advantage code moved, update tests/advantages/test_peers_trl.py"
        )
    last = [i for i in range(first[0], len(lines)) if end in lines[i]]
    if not last:
        pytest.fail(
            f"TRL {trl.__version__}: no line containing {end!r} after {start!r} in {where}; "
            f"TRL's advantage code changed, update tests/advantages/test_peers_trl.py"
        )
    return textwrap.dedent("\n".join(lines[first[0] : last[0] + 1]))


@functools.lru_cache(maxsize=None)
def sync_block():
    where = "trl.trainer.grpo_trainer.GRPOTrainer._generate_and_score_completions"
    text = _cut(inspect.getsource(GRPOTrainer._generate_and_score_completions), SYNC_START, SYNC_END, where)
    return text, compile(text, f"<TRL {trl.__version__} {where}>", "exec")


@functools.lru_cache(maxsize=None)
def async_block():
    import trl.experimental.async_grpo.async_rollout_worker as worker

    where = "trl.experimental.async_grpo.async_rollout_worker"
    text = _cut(inspect.getsource(worker), ASYNC_START, ASYNC_END, where)
    return text, compile(text, f"<TRL {trl.__version__} {where}>", "exec")


def trl_grpo_advantages(rewards_per_func, num_generations, reward_weights, scale_rewards, aggregation):
    """TRL's own GRPOTrainer advantage code on these inputs (``reward_weights`` is TRL's
    ``self.reward_weights``: ones unless ``GRPOConfig.reward_weights`` is set)."""
    K = rewards_per_func.shape[1]
    if reward_weights is None:
        reward_weights = torch.ones(K, dtype=torch.float32)
    self = types.SimpleNamespace(
        multi_objective_aggregation=aggregation,
        scale_rewards=scale_rewards,
        reward_weights=reward_weights.clone(),
        reward_funcs=[object() for _ in range(K)],
    )
    namespace = dict(
        self=self,
        rewards_per_func=rewards_per_func.clone(),
        num_generations=num_generations,
        device=rewards_per_func.device,
        torch=torch,
        nanstd=nanstd,
    )
    exec(sync_block()[1], namespace)
    return namespace["advantages"]


def trl_async_advantages(rewards_per_func, num_generations):
    """TRL's async rollout worker, one group at a time as it runs, concatenated; the worker
    gets ``all_rewards`` as [n_funcs][G] lists (None already turned into NaN)."""
    out = []
    for start in range(0, rewards_per_func.shape[0], num_generations):
        group = rewards_per_func[start : start + num_generations]
        namespace = dict(np=np, all_rewards=group.T.tolist())
        exec(async_block()[1], namespace)
        out.append(namespace["advantages"])
    return np.concatenate(out)


# ---------------------------------------------------------------------------------------
# Random TRL reward tables
# ---------------------------------------------------------------------------------------

KINDS = ("binary", "int", "gaussian")


@st.composite
def reward_tables(draw):
    return dict(
        num_generations=draw(st.integers(2, 16)),
        num_prompts=draw(st.integers(1, 8)),
        kinds=draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3)),
        p_nan=draw(st.sampled_from([0.0, 0.15, 0.5])),
        p_unscorable=draw(st.sampled_from([0.0, 0.1, 0.3])),
        unscorable_group=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def make_rewards(spec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(spec["seed"])
    G, P = spec["num_generations"], spec["num_prompts"]
    B = G * P
    cols = []
    for kind in spec["kinds"]:
        if kind == "binary":
            cols.append(torch.randint(0, 2, (B,), generator=gen).float())
        elif kind == "int":
            cols.append(torch.randint(-2, 6, (B,), generator=gen).float())
        else:
            cols.append(torch.randn(B, generator=gen))
    r = torch.stack(cols, dim=1)
    r[torch.rand(r.shape, generator=gen) < spec["p_nan"]] = float("nan")  # a function returned None
    r[torch.rand(B, generator=gen) < spec["p_unscorable"]] = float("nan")  # every function returned None
    if spec["unscorable_group"]:
        g = int(torch.randint(0, P, (), generator=gen))
        r[g * G : (g + 1) * G] = float("nan")
    return r


def draw_weights(kind, K, gen):
    """TRL's ``reward_weights``: None (ones), random on a 1/8 grid in [-2, 3] (exact float32
    sums of 0/1/integer rewards), or arbitrary random floats in [-2, 3]."""
    if kind == "default":
        return None
    if kind == "dyadic":
        return torch.randint(-16, 25, (K,), generator=gen).float() / 8
    return torch.rand(K, generator=gen) * 5 - 2


def check(ours, theirs, *, atol=ATOL, rtol=RTOL, what=""):
    assert isinstance(ours, torch.Tensor)
    assert ours.dtype == theirs.dtype, f"{what}: dtype {ours.dtype} != TRL's {theirs.dtype}"
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} != TRL's {theirs.shape}"
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol, msg=lambda m: f"{what}\n{m}")


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


def test_trl_blocks_found():
    """The marker lines still cut TRL's advantage code (else every test below fails)."""
    sync_text, _ = sync_block()
    assert "nanstd(" in sync_text and "1e-4" in sync_text and "normalize_then_sum" in sync_text
    async_text, _ = async_block()
    assert "scored.std()" in async_text and "1e-8" in async_text


SCALES = ["group", "batch", "none"]
AGGREGATIONS = ["sum_then_normalize", "normalize_then_sum"]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("scale_rewards", SCALES)
@settings(max_examples=EXAMPLES)
@given(spec=reward_tables(), weights=st.sampled_from(["default", "dyadic", "float"]))
def test_grpo_advantages_match_trl(scale_rewards, aggregation, spec, weights):
    """fp32, as TRL runs: 1..3 reward functions, NaN entries, unscorable rows and groups,
    num_generations 2..16, default or random reward_weights (see the module docstring)."""
    r = make_rewards(spec)
    w = draw_weights(weights, r.shape[1], torch.Generator().manual_seed(spec["seed"] ^ 0xBEEF))
    G = spec["num_generations"]
    theirs = trl_grpo_advantages(r, G, w, scale_rewards, aggregation)
    w64 = torch.ones(r.shape[1], dtype=torch.float64) if w is None else w.double()
    exact = trl_grpo_advantages(r.double(), G, w64, scale_rewards, aggregation).float()

    r_in, w_in = r.clone(), (None if w is None else w.clone())
    mine = compute_grpo_advantages(
        r_in, G, reward_weights=w_in, scale_rewards=scale_rewards, multi_objective_aggregation=aggregation
    )
    assert torch.equal(r_in.isnan(), r.isnan()) and torch.equal(r_in.nan_to_num(), r.nan_to_num())
    assert w is None or torch.equal(w_in, w)

    what = f"{scale_rewards}/{aggregation} spec={spec} w={w}"
    check(mine, exact, what="vs TRL's code in float64: " + what)
    if torch.allclose(theirs, exact, atol=ATOL / 4, rtol=RTOL / 4):
        check(mine, theirs, what="vs TRL: " + what)
        event("compared with TRL's float32 output")
    else:
        event("TRL's float32 rounding above 2.5e-7: float64 only")
    # Unscorable rows (every function NaN) get 0 in both.
    assert (mine[r.isnan().all(dim=1)] == 0).all()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("scale_rewards", SCALES)
@settings(max_examples=10)
@given(spec=reward_tables())
def test_grpo_advantages_match_trl_fp64(scale_rewards, aggregation, spec):
    """float64 in, float64 out, like TRL's block: arbitrary float weights, every reward
    kind. (Not tighter than 1e-6: TRL's ``nanstd`` forms its Bessel factor
    ``count / (count - 1)`` from int64 counts, i.e. in float32, so its float64 std is off
    by up to ~3e-8 relative.)"""
    r = make_rewards(spec).double()
    w = draw_weights("float", r.shape[1], torch.Generator().manual_seed(spec["seed"] ^ 0xF00D)).double()
    G = spec["num_generations"]
    theirs = trl_grpo_advantages(r, G, w, scale_rewards, aggregation)
    mine = compute_grpo_advantages(
        r.clone(), G, reward_weights=w.clone(), scale_rewards=scale_rewards, multi_objective_aggregation=aggregation
    )
    check(mine, theirs, what=f"{scale_rewards}/{aggregation} spec={spec}")


def test_degenerate_group_with_inexact_weights():
    """The fp32 exception, pinned: a group of equal rewards 3 × 2.8425727. TRL's
    fp32 nanmean misses the value by an ulp and returns ulp / 1e-4 instead of 0; ours is 0."""
    r = torch.tensor([[1.0, float("nan"), 1.0], [1.0, 0.0, 1.0], [1.0, 0.0, 1.0]])
    w = torch.tensor([1.1232, 1.0345, 1.7193])
    mine = compute_grpo_advantages(r, 3, reward_weights=w)
    assert torch.equal(mine, torch.zeros(3))
    theirs = trl_grpo_advantages(r, 3, w, "group", "sum_then_normalize")
    ulp = 2 * torch.finfo(torch.float32).eps  # float32 spacing in [2, 4)
    assert theirs.abs().max() <= 2 * ulp / 1e-4  # TRL's float32 rounding noise (2.4e-3 in TRL 1.16)
    assert torch.equal(
        trl_grpo_advantages(r.double(), 3, w.double(), "group", "sum_then_normalize"),
        torch.zeros(3, dtype=torch.float64),
    )


@settings(max_examples=EXAMPLES)
@given(spec=reward_tables(), as_float64=st.booleans())
def test_async_grpo_advantages_match_trl(spec, as_float64):
    """AsyncGRPO rollout worker: per group, nansum over functions, population std, eps 1e-8,
    unscorable completions 0; TRL works in numpy float64 (so does ours), ours returns float32."""
    r = make_rewards(spec)
    G = spec["num_generations"]
    theirs = torch.from_numpy(trl_async_advantages(r, G))
    assert theirs.dtype == torch.float64
    r_in = r.double() if as_float64 else r.clone()
    mine = compute_async_grpo_advantages(r_in, G)
    assert mine.dtype == torch.float32
    check(mine, theirs.to(torch.float32), what=f"async spec={spec}")
    assert (mine[r.isnan().all(dim=1)] == 0).all()
