"""``integrations.trl.apply()`` on TRL 1.16's real ``GRPOTrainer``: a tiny Qwen2 with a
character tokenizer, a programmatic reward, 4 steps, ``steps_per_generation=2`` (so the clip
ratios are not zero), trained stock and applied in separate processes with the same seed
(tests/integrations/trl_grpo_runner.py, every configuration in one process per mode).

Per configuration: identical generations (under bf16 autocast, those before the first
update); at step 1 every logged metric and every micro-batch loss within 1e-6; final
parameters within 1e-3 of the total update; the call counts show each patched part ran and
TRL's chunked log-prob function and ``_compute_loss`` did not. Plus: strict refusal of an
unsupported option, strict=False's one warning and stock numbers, ``unapply()`` restoring
the identical objects and a stock run bit for bit, PatchError on a changed TRL method, and
all-or-nothing patching.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _runner():
    spec = importlib.util.spec_from_file_location("trl_grpo_runner", os.path.join(HERE, "trl_grpo_runner.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUNNER = _runner()
CONFIGS = list(RUNNER.CONFIGS)
TRAINED = [n for n in CONFIGS if "expect_error" not in RUNNER.CONFIGS[n][1]]
FUSED = [n for n in TRAINED if RUNNER.CONFIGS[n][1].get("strict", True)]
# fp32 runs, compared to 1e-6; the bf16-autocast one by the tolerance rule (its own test).
EXACT = [n for n in TRAINED if not RUNNER.CONFIGS[n][1].get("autocast")]
UNAPPLIED = ["grpo", "grpo_beta", "top_entropy"]


@pytest.fixture(scope="module")
def runs():
    """{mode: {config: result}} from three processes run side by side."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {}
        for mode, names in (("stock", CONFIGS), ("applied", CONFIGS), ("unapplied", UNAPPLIED)):
            out = os.path.join(tmp, f"{mode}.pt")
            log = open(os.path.join(tmp, f"{mode}.log"), "w")
            cmd = [sys.executable, os.path.join(HERE, "trl_grpo_runner.py"), mode, out, *names]
            jobs[mode] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), out, log)
        results = {}
        for mode, (proc, out, log) in jobs.items():
            rc = proc.wait(timeout=900)
            log.close()
            if rc != 0:
                with open(log.name) as f:
                    tail = f.read()[-6000:]
                pytest.fail(f"trl_grpo_runner.py {mode} failed (rc={rc}):\n{tail}")
            results[mode] = torch.load(out, weights_only=False)
    return results


def _close(a, b, tol=1e-6) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return abs(a - b) <= tol * (1 + abs(a))


def _steps(result):
    return [e for e in result["logs"] if "train_runtime" not in e and "eval_loss" not in e]


def _evals(result):
    return [e for e in result["logs"] if "eval_loss" in e]


def _timing(key: str) -> bool:
    return "time" in key or "per_second" in key


def _compared_generations(name: str) -> int:
    """How many micro-batches' generations must be identical: all of them for the fp32
    runs; under bf16 autocast only the first generation round's, which precede any update.
    After that the two runs' parameters differ by rounding (see the tolerance-rule test),
    and a sampled token whose probabilities are near a tie may come out differently."""
    kw = {**RUNNER.BASE, **RUNNER.CONFIGS[name][0]}
    if RUNNER.CONFIGS[name][1].get("autocast"):
        return kw["steps_per_generation"]
    return 10**9


@pytest.mark.parametrize("name", TRAINED)
def test_generations_identical(runs, name):
    stock, applied = runs["stock"][name], runs["applied"][name]
    n = _compared_generations(name)
    assert len(stock["completions"]) == len(applied["completions"]) > 0
    assert stock["completions"][:n] == applied["completions"][:n]
    assert stock["masks"][:n] == applied["masks"][:n]
    for s, a in zip(stock["advantages"][:n], applied["advantages"][:n]):
        assert max(abs(x - y) for x, y in zip(s, a)) <= 1e-6


@pytest.mark.parametrize("name", EXACT)
def test_step1_metrics_and_losses(runs, name):
    stock, applied = runs["stock"][name], runs["applied"][name]
    s_steps, a_steps = _steps(stock), _steps(applied)
    assert len(s_steps) == len(a_steps) == RUNNER.BASE["max_steps"] or "max_steps" in RUNNER.CONFIGS[name][0]
    for s, a in zip(s_steps, a_steps):
        assert set(s) == set(a)  # TRL's full metric set, under TRL's names, at every step
    first_s, first_a = s_steps[0], a_steps[0]
    for key in first_s:
        if not _timing(key):
            assert _close(first_s[key], first_a[key]), (key, first_s[key], first_a[key])
    overrides = RUNNER.CONFIGS[name][0]
    per_step = overrides.get("gradient_accumulation_steps", 1)
    assert all(stock["training"][:per_step])
    for s, a in zip(stock["losses"][:per_step], applied["losses"][:per_step]):
        assert abs(s - a) <= 1e-6, (s, a)
    # Eval (TRL's eval mode of the loss: no accumulation scaling) after two updates.
    s_evals, a_evals = _evals(stock), _evals(applied)
    assert len(s_evals) == len(a_evals)
    for s, a in zip(s_evals, a_evals):
        assert set(s) == set(a)
        for key in s:
            if not _timing(key):
                assert _close(s[key], a[key], 1e-4), (key, s[key], a[key])
    # Later micro-batches see parameters that differ by float rounding only.
    for s, a in zip(stock["losses"], applied["losses"]):
        assert abs(s - a) <= 1e-4 * (1 + abs(s))


@pytest.mark.parametrize("name", EXACT)
def test_final_parameters(runs, name):
    stock, applied = runs["stock"][name], runs["applied"][name]
    diff = math.sqrt(sum(float(((stock["theta"][k] - applied["theta"][k]) ** 2).sum()) for k in stock["theta"]))
    update = math.sqrt(sum(float(((stock["theta"][k] - stock["theta0"][k]) ** 2).sum()) for k in stock["theta"]))
    for k in stock["theta0"]:
        assert torch.equal(stock["theta0"][k], applied["theta0"][k])
    assert diff <= 1e-3 * update + 1e-7, (diff, update)


@pytest.mark.parametrize("name", TRAINED)
def test_each_patched_part_ran(runs, name):
    counts, stock_counts = runs["applied"][name]["counts"], runs["stock"][name]["counts"]
    micro_batches = len(runs["applied"][name]["losses"])
    # The stock run used TRL's own code (the spies count it).
    assert stock_counts["stock:ChunkedLogProbFunction.forward"] > 0
    assert stock_counts["stock:GRPOTrainer._compute_loss"] == micro_batches
    assert counts.get("trl.kernels.ChunkedLogProbFunction", 0) > 0
    assert counts.get("stock:ChunkedLogProbFunction.forward", 0) == 0
    kw = {**RUNNER.BASE, **RUNNER.CONFIGS[name][0]}
    training = runs["applied"][name]["training"]
    rounds = math.ceil(sum(training) / (kw["steps_per_generation"] * kw.get("num_iterations", 1)))
    rounds += len(training) - sum(training)  # eval: one generation per eval micro-batch
    assert counts.get("trl.GRPOTrainer.advantages", 0) == rounds  # once per generation round
    if name in FUSED:
        assert counts.get("trl.GRPOTrainer._compute_loss", 0) == micro_batches
        assert counts.get("stock:GRPOTrainer._compute_loss", 0) == 0
        assert runs["applied"][name]["warnings"] == []
    else:  # strict=False with an option the fused loss lacks: TRL's own loss, every call
        assert counts.get("trl.GRPOTrainer._compute_loss", 0) == 0
        assert counts["trl.GRPOTrainer._compute_loss[trl fallback]"] == micro_batches
        assert counts["stock:GRPOTrainer._compute_loss"] == micro_batches


def test_bf16_autocast_within_the_tolerance_rule(runs):
    """Under TRL's default bf16 autocast both runs round differently (TRL rounds each logits
    tile to bf16; the fused head keeps fp32 logits but bf16 gradients, as autocast's own
    linear does), and AdamW turns rounding into sign flips of small gradients: neither run
    is the fp32 one. The applied run must be as close to the fp32 run ("dapo", same
    settings) as stock is: |applied − fp32| <= 2·|stock − fp32| (+ atol), on the first
    step's metrics and the final parameters."""
    fp32 = runs["stock"]["dapo"]
    stock, applied = runs["stock"]["bf16_autocast"], runs["applied"]["bf16_autocast"]
    n = _compared_generations("bf16_autocast")  # generation does not run the patched parts
    assert stock["completions"][:n] == applied["completions"][:n]

    def dist(theta):
        return math.sqrt(sum(float(((theta[k] - fp32["theta"][k]) ** 2).sum()) for k in theta))

    assert dist(applied["theta"]) <= 2 * dist(stock["theta"]) + 1e-6
    first_fp32, first_s, first_a = _steps(fp32)[0], _steps(stock)[0], _steps(applied)[0]
    assert set(first_s) == set(first_a)
    for key in first_s:
        if not _timing(key) and isinstance(first_s[key], float):
            assert abs(first_a[key] - first_fp32[key]) <= 2 * abs(first_s[key] - first_fp32[key]) + 1e-3, key


def test_eval_mode_is_exercised(runs):
    evals = _evals(runs["stock"]["eval"])
    assert len(evals) == 2 and "eval_entropy" in evals[0] and "eval_clip_ratio/region_mean" in evals[0]


def test_clip_ratios_are_exercised(runs):
    """The configurations do clip (otherwise the clip metrics would compare zeros)."""
    logs = [e for n in FUSED for e in _steps(runs["stock"][n])]
    assert max(e.get("clip_ratio/region_mean") or 0.0 for e in logs) > 0.1
    assert max(e.get("clip_ratio/low_mean") or 0.0 for e in logs) > 0.0
    assert max(e.get("cispo_clip_ratio") or 0.0 for e in logs) > 0.0
    assert max(e.get("vespo/phi_seq_mean") or 0.0 for e in logs) > 0.0


def test_off_policy_mask_drops_sequences(runs):
    """The off-policy mask configuration does drop sequences: its loss differs from the
    same run without the mask (dapo) once the policy has moved."""
    masked, plain = runs["stock"]["off_policy_mask"]["losses"], runs["stock"]["dapo"]["losses"]
    assert masked[0] == plain[0] and masked != plain


def test_empty_completions_are_exercised(runs):
    for name in ("masked_truncated", "masked_dapo_batch"):
        masks = runs["stock"][name]["masks"]
        assert any(sum(row) == 0 for mb in masks for row in mb), name  # masked (empty) completions
    assert any(sum(row) > 0 for mb in runs["stock"]["masked_dapo_batch"]["masks"] for row in mb)


def test_strict_refuses_unsupported_option(runs):
    error = runs["applied"]["delta_below_one_strict"].get("error", "")
    assert "delta" in error and "strict=False" in error
    assert "error" not in runs["stock"]["delta_below_one_strict"]


def test_non_strict_warns_once(runs):
    warned = runs["applied"]["delta_below_one_fallback"]["warnings"]
    assert len(warned) == 1 and "delta" in warned[0]


@pytest.mark.parametrize("name", UNAPPLIED)
def test_stock_after_unapply_equals_stock_bit_for_bit(runs, name):
    stock, again = runs["stock"][name], runs["unapplied"][name]
    assert again["counts"].get("trl.GRPOTrainer._compute_loss", 0) == 0
    assert stock["completions"] == again["completions"]
    assert stock["losses"] == again["losses"]
    assert [{k: v for k, v in e.items() if not _timing(k)} for e in stock["logs"]] == [
        {k: v for k, v in e.items() if not _timing(k)} for e in again["logs"]
    ]
    for k in stock["theta"]:
        assert torch.equal(stock["theta"][k], again["theta"][k])


# ---------------------------------------------------------------------------------------
# In process: what apply() replaces, unapply(), errors
# ---------------------------------------------------------------------------------------


def _trl_objects():
    import trl.experimental.async_grpo.async_grpo_trainer as async_trainer
    import trl.experimental.async_grpo.packing as async_packing
    import trl.trainer.utils as utils
    from transformers import AttentionInterface
    from trl.trainer.grpo_trainer import GRPOTrainer

    return {
        "async_grpo_trainer.TreeRow": async_trainer.TreeRow,
        "packing.TreeRow": async_packing.TreeRow,
        "packing.tree_attention": async_packing.tree_attention,
        "AsyncGRPOTrainer.compute_loss": vars(async_trainer.AsyncGRPOTrainer)["compute_loss"],
        "AttentionInterface[tree]": AttentionInterface._global_mapping.get(async_packing.TREE_ATTENTION),
        "utils._ChunkedLogProbFunction": utils._ChunkedLogProbFunction,
        "utils._use_triton": utils._use_triton,
        "GRPOTrainer._compute_loss": vars(GRPOTrainer)["_compute_loss"],
        "GRPOTrainer.__init__": vars(GRPOTrainer)["__init__"],
        "GRPOTrainer._generate_and_score_completions": vars(GRPOTrainer)["_generate_and_score_completions"],
    }


def test_apply_unapply_restores_identical_objects():
    from rlvr_kernels.integrations import trl as rk_trl
    from rlvr_kernels.integrations.trl.kernels import ChunkedLogProbFunction

    assert not rk_trl.is_applied() and rk_trl.unapply() is False
    before = _trl_objects()
    rk_trl.apply()
    try:
        after = _trl_objects()
        assert rk_trl.is_applied() and rk_trl.applied_options()["loss"] is True
        assert all(after[k] is not before[k] for k in before)
        assert after["utils._ChunkedLogProbFunction"] is ChunkedLogProbFunction
        # TRL's advantage block is gone from the method; the rest is TRL's.
        code = inspect.unwrap(after["GRPOTrainer._generate_and_score_completions"]).__code__
        assert "mean_grouped_rewards" not in code.co_varnames and "is_std_zero" in code.co_varnames
        assert "_rlvr_grpo_advantages" in code.co_freevars
        # apply() again: the last call's switches win, nothing is stacked.
        rk_trl.apply(loss=False)
        again = _trl_objects()
        assert again["GRPOTrainer._compute_loss"] is before["GRPOTrainer._compute_loss"]
        assert again["utils._ChunkedLogProbFunction"] is ChunkedLogProbFunction
    finally:
        assert rk_trl.unapply() is True
    restored = _trl_objects()
    assert all(restored[k] is before[k] for k in before)
    assert rk_trl.unapply() is False and not rk_trl.is_applied()


def test_all_or_nothing(monkeypatch):
    """A failing part (here the AsyncGRPOTrainer part) leaves TRL untouched."""
    from rlvr_kernels.integrations import trl as rk_trl
    from rlvr_kernels.integrations.trl import patch

    def fail(*, strict, loss):
        raise RuntimeError("async part failed")

    monkeypatch.setattr(patch, "async_targets", fail)
    before = _trl_objects()
    with pytest.raises(RuntimeError, match="async part failed"):
        rk_trl.apply()
    assert not rk_trl.is_applied()
    assert all(_trl_objects()[k] is before[k] for k in before)


def test_version_outside_tested_range(monkeypatch):
    import trl

    from rlvr_kernels.integrations import trl as rk_trl
    from rlvr_kernels.integrations._patch import PatchError

    before = _trl_objects()
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(PatchError, match=r"trl 1\.17\.0 .*1\.16\.0"):
        rk_trl.apply()
    assert all(_trl_objects()[k] is before[k] for k in before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rk_trl.apply(strict=False)
    try:
        assert any("outside the range" in str(w.message) for w in caught)
    finally:
        rk_trl.unapply()


def test_changed_trl_method_raises_patch_error():
    """The advantage block is found by its AST: a method without it, with a changed block,
    or whose later code reads another of its names, is refused (PatchError)."""
    import trl.trainer.grpo_trainer as grpo

    from rlvr_kernels.integrations._patch import PatchError
    from rlvr_kernels.integrations.trl import _grpo_patch

    name = "_generate_and_score_completions"
    original = inspect.unwrap(vars(grpo.GRPOTrainer)[name])
    lines, first = inspect.getsourcelines(original)
    source = "".join(lines)
    assert "_rlvr_grpo_advantages(self" in _grpo_patch.patched_source(lines, first, name)

    class Fake:
        def _generate_and_score_completions(self, inputs):
            return inputs

    with pytest.raises(PatchError, match="expected one advantage block"):
        _grpo_patch.rewrite_generate_and_score(Fake, Fake._generate_and_score_completions, grpo)
    # One changed constant in the block (the 1e-4 added to the std) changes its AST hash.
    assert "(std_rewards + 1e-4)" in source
    changed = source.replace("(std_rewards + 1e-4)", "(std_rewards + 1e-5)", 1)
    with pytest.raises(PatchError, match="differs from TRL 1.16.0"):
        _grpo_patch.patched_source(changed.splitlines(True), first, name)
    # A later read of std_rewards (a name only TRL's block defines) is refused.
    assert source.count("# Slice to keep only") == 1
    reads = source.replace("# Slice to keep only", "print(std_rewards)  # Slice to keep only")
    with pytest.raises(PatchError, match="std_rewards"):
        _grpo_patch.patched_source(reads.splitlines(True), first, name)
    # Comments and formatting inside the block do not matter.
    assert "        # Unscorable completions" in source
    _grpo_patch.patched_source(source.replace("# for logging", "# (logged)").splitlines(True), first, name)


def test_std_zero_flag_matches_trl():
    """``is_std_zero`` (logged as frac_reward_zero_std) as TRL defines it, for each scale and
    aggregation, with unscorable rows and zero-variance groups."""
    from trl.trainer.utils import nanstd

    from rlvr_kernels.integrations.trl._grpo_patch import _reward_std_is_zero

    rpf = torch.tensor(
        [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.5, 2.0], [math.nan, 1.0], [math.nan, math.nan], [2.0, 0.0]]
    )
    w = torch.tensor([1.0, 0.5])
    G = 4
    unscorable = torch.isnan(rpf).all(1)
    r = (rpf * w).nansum(1)
    r[unscorable] = math.nan
    group = nanstd(r.view(-1, G), dim=1).repeat_interleave(G)
    for scale in ("group", "none"):
        expect = torch.isclose(group, torch.zeros_like(group))
        assert torch.equal(_reward_std_is_zero(rpf, w, G, scale, "sum_then_normalize"), expect)
    batch = nanstd(r).expand_as(r)
    assert torch.equal(
        _reward_std_is_zero(rpf, w, G, "batch", "sum_then_normalize"), torch.isclose(batch, torch.zeros_like(batch))
    )
    assert bool(_reward_std_is_zero(rpf, w, G, "group", "sum_then_normalize")[:4].all())
    assert not bool(_reward_std_is_zero(rpf, w, G, "group", "normalize_then_sum").any())
    const = torch.ones(8, 2)
    assert bool(_reward_std_is_zero(const, w, G, "group", "normalize_then_sum").all())
