"""``rlvr_kernels.integrations.verl.apply()`` inside verl 0.9's own code, on CPU.

The actor path is verl's FSDP engine itself (``FSDPEngineWithLMHead``: ``train_batch`` =
zero_grad, ``forward_backward_batch`` over the micro-batches (verl's ``prepare_model_inputs``,
the model, ``prepare_model_outputs`` with ``logprobs_from_logits`` / ``entropy_from_logits``,
the engine's ``ppo_loss`` bound with ``functools.partial`` as verl's worker binds it,
backward), ``optimizer_step``; ``infer_batch`` for compute_log_prob) on a tiny Qwen2 built
from a config, a single process with a gloo group. verl 0.9.1 has no CPU platform (its
device lookups fall back to CUDA) and its worker classes import the rollout server's
packages, so the engine is built by ``rlvr_kernels.testing.verl_engine`` (shared with the
verl step benchmark): the engine module's two device lookups on the CPU, no device mesh
(world size 1), the plain module and a plain SGD instead of the FSDP-wrapped ones;
everything between is verl's code. Stock and
applied runs start from the same weights and data and must agree to 1e-6 (losses per
micro-batch, every metric, gradients, the parameters after the step); the call counts
prove the fused functions ran.

Advantages: verl's ``compute_advantage`` (ray_trainer) needs the Ray trainer's packages,
so the test makes its two calls itself: ``core_algos.compute_grpo_outcome_advantage`` for
GRPO (by module attribute, as compute_advantage does) and ``get_adv_estimator_fn(name)``
with compute_advantage's keyword arguments for the rest.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
import warnings

import numpy as np
import pytest
import torch
import transformers
import verl
import verl.utils.torch_functional as verl_F
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.utils.kernel import linear_cross_entropy as verl_lce
from verl.workers.config import FSDPActorConfig
from verl.workers.config.actor import PolicyLossConfig
from verl.workers.engine.fsdp import transformer_impl as ti
from verl.workers.utils import losses as verl_losses

from rlvr_kernels.integrations import verl as rk
from rlvr_kernels.integrations._patch import PatchError, call_counts, reset_call_counts, set_counting
from rlvr_kernels.integrations.verl import patch as rk_patch
from rlvr_kernels.testing import verl_engine
from rlvr_kernels.testing.dist import single_process_group

V, B, P, R = 97, 6, 5, 7


# ---------------------------------------------------------------------------------------
# fixtures: one gloo process, a tiny model, verl's engine on CPU
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def gloo():
    with single_process_group():
        yield


@pytest.fixture(autouse=True)
def clean_patch():
    set_counting(True)
    reset_call_counts()
    yield
    rk.unapply()
    set_counting(False)
    reset_call_counts()


@pytest.fixture(scope="module")
def model_dir():
    # a head scaled ×20: peaked distributions, ratios far from 1 after a step
    return verl_engine.saved_qwen2(
        vocab=V, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, max_positions=64, head_scale=20.0
    )


def _cpu_engine(monkeypatch, model_dir, torch_compile=False):
    return verl_engine.cpu_engine(monkeypatch, model_dir, micro_batch_size=2, torch_compile=torch_compile)


def _batch(seed=0):
    return verl_engine.rollout_batch(vocab=V, batch=B, prompt=P, response=R, seed=seed)


def _td(batch: DataProto, *, entropy: bool, fused_kernels: bool = False, train: bool = True, is_weights=False):
    return verl_engine.worker_batch(
        batch, micro_batch_size=2, entropy=entropy, fused_kernels=fused_kernels, train=train, is_weights=is_weights
    )


def _actor_config(loss_mode="vanilla", agg="token-mean", **kw) -> FSDPActorConfig:
    fields = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=agg)
    fields.update(kw)
    return verl_engine.actor_config(loss_mode, batch_size=B, micro_batch_size=2, **fields)


def _train(monkeypatch, model_dir, config, *, entropy, is_weights=False, steps=2):
    """``steps`` train_batch calls on verl's engine (the second sees a moved policy: ratios ≠ 1);
    per step: the micro-batch losses, the metrics, the gradients; then the total update."""
    engine = _cpu_engine(monkeypatch, model_dir)
    start = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    loss_fn = functools.partial(verl_losses.ppo_loss, config=config)  # as engine_workers binds it
    steps_out = []
    for _ in range(steps):
        out = engine.train_batch(_td(_batch(), entropy=entropy, is_weights=is_weights), loss_function=loss_fn)
        grads = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        metrics = {k: (v.values if hasattr(v, "values") else v) for k, v in out["metrics"].items()}
        steps_out.append((out["loss"], metrics, grads))
    update = {n: p.detach() - start[n] for n, p in engine.module.named_parameters()}
    return steps_out, update


def _close(a, b, tol=1e-6, key=None):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        for k in a:
            _close(a[k], b[k], tol, k)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y, tol, key)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    elif isinstance(a, float):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (key, a, b)
    else:
        assert a == b, (key, a, b)


# ---------------------------------------------------------------------------------------
# the actor update and compute_log_prob through verl's engine
# ---------------------------------------------------------------------------------------

TRAIN_CASES = [
    # (loss_mode, loss_agg_mode, extra config, entropy, rollout_is_weights)
    ("vanilla", "token-mean", dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1), True, False),
    ("vanilla", "seq-mean-token-sum", dict(use_kl_loss=True, kl_loss_type="k2", kl_loss_coef=0.05), False, True),
    ("gspo", "seq-mean-token-mean", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4), False, False),
    ("cispo", "token-mean", dict(entropy_coeff=0.02), True, False),
    ("sapo", "token-mean", dict(tau_pos=1.0, tau_neg=1.05, use_kl_loss=True, kl_loss_coef=0.1), False, False),
    ("gpg", "seq-mean-token-sum-norm", {}, False, False),
    # (thresholds small enough that the moved policy of step 2 leaves the trust region)
    ("dppo_tv", "token-mean", dict(clip_ratio_low=1e-4, clip_ratio_high=2e-4, clip_ratio_c=1.001), True, True),
    ("dppo_kl", "seq-mean-token-mean", dict(clip_ratio_low=1e-7, clip_ratio_high=1e-6, use_kl_loss=True), False, False),
    # (geo_mean's pg term is a mean over the rows: KL / entropy take a second call, also under its own agg)
    ("geo_mean", "token-mean", dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1), True, True),
    ("geo_mean", "seq-mean-token-sum", dict(use_kl_loss=True, kl_loss_type="k2", kl_loss_coef=0.05), False, False),
    (
        "dro",
        "token-mean",
        dict(policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=0.5), entropy_coeff=0.01),
        True,
        True,
    ),
    (
        "dro",
        "seq-mean-token-mean",
        dict(policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=2.0), use_kl_loss=True, kl_loss_coef=0.1),
        False,
        False,
    ),
    (
        "clip_cov",
        "token-mean",
        dict(
            policy_loss=PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-1.0, clip_cov_ub=5.0),
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.1,
        ),
        True,
        True,
    ),
    (
        "clip_cov",
        "seq-mean-token-sum",
        dict(policy_loss=PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-1.0)),
        False,
        False,
    ),
    (
        "kl_cov",
        "seq-mean-token-sum",
        dict(policy_loss=PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.05, ppo_kl_coef=0.5), use_kl_loss=True),
        False,
        True,
    ),
    (
        "kl_cov",
        "token-mean",
        dict(policy_loss=PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.1), entropy_coeff=0.02),
        True,
        False,
    ),
]
# every mode of verl's registry but bypass_mode (a rollout correction: its own tests)
assert {case[0] for case in TRAIN_CASES} == set(core_algos.POLICY_LOSS_REGISTRY) - {"bypass_mode"}


@pytest.mark.parametrize("loss_mode,agg,extra,entropy,is_weights", TRAIN_CASES)
def test_engine_update_matches_stock(monkeypatch, model_dir, loss_mode, agg, extra, entropy, is_weights):
    """The fused ppo_loss against verl's; the runs are seeded alike (clip_cov draws torch.randperm)."""
    torch.manual_seed(7)
    stock = _train(
        monkeypatch, model_dir, _actor_config(loss_mode, agg, **extra), entropy=entropy, is_weights=is_weights
    )
    assert call_counts() == {}
    rk.apply(count_calls=True)
    torch.manual_seed(7)
    ours = _train(
        monkeypatch, model_dir, _actor_config(loss_mode, agg, **extra), entropy=entropy, is_weights=is_weights
    )
    counts = call_counts()
    micro = 2 * (B // 2)  # steps × micro-batches
    assert counts["verl.ppo_loss"] == micro
    # the engine's forward is logit-free: the log-probs (and entropy) from the hidden states
    assert counts["verl.forward_step"] == micro
    assert "verl.logprobs_from_logits" not in counts and "verl.entropy_from_logits" not in counts, counts
    assert not any(k.endswith("[verl]") for k in counts), counts
    # dppo: the moved policy of step 2 leaves the trust region somewhere; clip_cov: some tokens are selected
    if loss_mode.startswith("dppo") or loss_mode == "clip_cov":
        clipfrac = stock[0][1][1]["actor/pg_clipfrac"]
        assert max(torch.as_tensor(clipfrac, dtype=torch.float64).reshape(-1).tolist()) > 0, clipfrac
    _same_training(ours, stock)


def _same_training(ours, stock):
    """Step 1: micro-batch losses, metrics (grad_norm included) and gradients to 1e-6; step 2
    (a moved policy): losses and metrics to 1e-5; the total update of every parameter within
    1e-5 of the largest update."""
    (l0, m0, g0), (l1, m1, g1) = stock[0][0], ours[0][0]
    _close(l1, l0)
    _close(m1, m0)
    _close(g1, g0)
    for (l0, m0, _), (l1, m1, _) in zip(stock[0][1:], ours[0][1:]):
        _close(l1, l0, 1e-5)
        _close(m1, m0, 1e-5)
    scale = max(float(u.abs().max()) for u in stock[1].values())
    assert scale > 0
    worst = max(float((ours[1][n] - u).abs().max()) for n, u in stock[1].items())
    assert worst <= 1e-5 * scale, (worst, scale)


REGISTRY_CASES = {
    "vanilla": {},
    "geo_mean": {},
    "dro": dict(policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=0.5)),
    "clip_cov": dict(policy_loss=PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-1.0)),
    "kl_cov": dict(policy_loss=PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.05, ppo_kl_coef=0.5)),
}


@pytest.mark.parametrize("loss_mode", sorted(REGISTRY_CASES))
def test_engine_update_with_registry_losses_only(monkeypatch, model_dir, loss_mode):
    """ppo_loss=False: verl's own ppo_loss runs and picks our drop-in from its registry (on
    the cpu backend); the runs are seeded alike, as clip_cov draws torch.randperm."""
    cfg = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, **REGISTRY_CASES[loss_mode])
    torch.manual_seed(7)
    stock = _train(monkeypatch, model_dir, _actor_config(loss_mode, **cfg), entropy=True)
    rk.apply(ppo_loss=False, logprobs=False, count_calls=True)
    torch.manual_seed(7)
    with rk.use_backend("cpu"):
        ours = _train(monkeypatch, model_dir, _actor_config(loss_mode, **cfg), entropy=True)
    counts = call_counts()
    assert counts == {f"verl.policy_loss.{loss_mode}": 2 * (B // 2)}, counts
    if loss_mode == "clip_cov":  # some tokens are selected
        clipfrac = stock[0][1][1]["actor/pg_clipfrac"]
        assert max(torch.as_tensor(clipfrac, dtype=torch.float64).reshape(-1).tolist()) > 0, clipfrac
    _same_training(ours, stock)


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_engine_update_bypass_mode(monkeypatch, model_dir, loss_type):
    """loss_mode="bypass_mode" (old_log_probs are the rollout's) with sequence IS and a
    chained rejection: fused into ppo_loss, the correction inside the kernel. One step: the
    rollout log-probs already differ from the policy's there, and verl's *_std metrics
    (E[s²] − E[s]² in fp32) move ~5e-4 for a 1e-6 change of the log-probs, more than a
    second step's tolerance allows for the rounding-level difference of the moved policies."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    def config():
        rcc = RolloutCorrectionConfig(
            loss_type=loss_type,
            rollout_is="sequence",
            rollout_is_threshold=2.0,
            rollout_rs="token_k1,seq_max_k3",
            rollout_rs_threshold="0.001_1000.0,8.0",
        )
        policy = PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rcc)
        return _actor_config("bypass_mode", policy_loss=policy, entropy_coeff=0.01)

    stock = _train(monkeypatch, model_dir, config(), entropy=True, steps=1)
    assert call_counts() == {}
    rk.apply(count_calls=True)
    ours = _train(monkeypatch, model_dir, config(), entropy=True, steps=1)
    counts = call_counts()
    assert counts["verl.ppo_loss"] == B // 2, counts
    assert not any(k.endswith("[verl]") for k in counts), counts
    fracs = stock[0][0][1]["rollout_corr/rollout_rs_masked_fraction"]
    assert "rollout_corr/rollout_is_mean" in stock[0][0][1]
    assert max(torch.as_tensor(fracs, dtype=torch.float64).reshape(-1).tolist()) > 0, fracs  # something rejected
    _same_training(ours, stock)


@pytest.mark.parametrize("torch_compile", [False, True])
def test_engine_compute_log_prob_matches_stock(monkeypatch, model_dir, torch_compile):
    """infer_batch (verl's compute_log_prob); with use_torch_compile (verl's default) the
    engine compiles the entropy function it binds, here ours."""

    def infer(compiled):
        engine = _cpu_engine(monkeypatch, model_dir, torch_compile=compiled)
        out = engine.infer_batch(_td(_batch(), entropy=True, train=False))
        mo = out["model_output"]
        return [mo["log_probs"].values(), mo["entropy"].values()]

    stock = infer(False)
    rk.apply()
    ours = infer(torch_compile)
    assert call_counts() == {"verl.forward_step": B // 2}
    _close(ours, stock, 1e-5 if torch_compile else 1e-6)
    # apply(logit_free=False): verl's logits path with the log-prob drop-ins
    reset_call_counts()
    rk.apply(logit_free=False)
    ours = infer(torch_compile)
    assert call_counts() == {"verl.logprobs_from_logits": B // 2, "verl.entropy_from_logits": B // 2}
    _close(ours, stock, 1e-5 if torch_compile else 1e-6)


def test_engine_fused_kernels_run_linear_cross_entropy(monkeypatch, model_dir):
    """use_fused_kernels: verl's fused model forward calls linear_cross_entropy (CUDA-only in
    verl); applied, it runs on CPU and gives the log-probs and entropy of the stock
    unfused path."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    def infer(fused):
        engine = _cpu_engine(monkeypatch, model_dir)
        if fused:
            # verl's fused-kernel model forward, set on a private subclass (verl sets it on the
            # model's class, which would leak into every later Qwen2 model of the session)
            engine.module.__class__ = type("FusedQwen2ForCausalLM", (transformers.Qwen2ForCausalLM,), {})
            patch_forward_with_backends(engine.module, use_fused_kernels=True, fused_kernels_backend="triton")
        out = engine.infer_batch(_td(_batch(), entropy=True, train=False, fused_kernels=fused))
        mo = out["model_output"]
        return [mo["log_probs"].values(), mo["entropy"].values()]

    stock = infer(False)
    rk.apply()
    ours = infer(True)
    assert call_counts().get("verl.linear_cross_entropy", 0) == B // 2, call_counts()
    _close(ours, stock, tol=1e-5)


# ---------------------------------------------------------------------------------------
# advantages through verl's registry (compute_advantage's two calls)
# ---------------------------------------------------------------------------------------

ESTIMATORS = [
    "grpo",
    "grpo_vectorized",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
    "gdpo",
]


def _compute_advantage(data: DataProto, name: str, config=None):
    """verl.trainer.ppo.ray_trainer.compute_advantage's calls for these estimators."""
    if name == "grpo":
        return core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=data.batch["token_level_rewards"],
            response_mask=data.batch["response_mask"],
            index=data.non_tensor_batch["uid"],
            norm_adv_by_std_in_grpo=True,
        )
    kwargs = dict(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        config=config,
        index=data.non_tensor_batch["uid"],
    )
    if name == "gdpo":
        kwargs.update(non_tensor_batch=data.non_tensor_batch, batch=data.batch)
    return core_algos.get_adv_estimator_fn(name)(**kwargs)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_advantages_match_stock(name):
    from omegaconf import OmegaConf

    g = torch.Generator().manual_seed(3)
    n, L = 12, 9
    mask = (torch.arange(L)[None] < torch.randint(1, L + 1, (n,), generator=g)[:, None]).float()
    rewards = torch.zeros(n, L)
    rewards[torch.arange(n), mask.sum(1).long() - 1] = torch.randint(0, 3, (n,), generator=g).float()
    uid = np.array(["a", "a", "a", "b", "b", "c", "c", "c", "c", "d", "a", "b"], dtype=object)
    non_tensors = dict(uid=uid)
    config = None
    if name == "gdpo":  # two reward terms, weighted, as verl's reward manager stores them
        non_tensors.update(
            fmt=np.array(torch.randint(0, 2, (n,), generator=g).tolist(), dtype=object),
            acc=np.array(torch.rand(n, generator=g).tolist(), dtype=object),
        )
        config = OmegaConf.create({"gdpo_reward_keys": ["fmt", "acc"], "gdpo_reward_weights": [1.0, 0.5]})
    tensors = dict(token_level_rewards=rewards, response_mask=mask)
    if name == "gdpo":  # verl's GDPO reads the response lengths from the prompts and the attention mask
        attention_mask = torch.cat([torch.ones(n, 3), mask], 1).long()
        tensors.update(prompts=torch.ones(n, 3, dtype=torch.long), attention_mask=attention_mask)
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    stock = _compute_advantage(data, name, config)
    rk.apply()
    ours = _compute_advantage(data, name, config)
    assert call_counts() == {f"verl.adv.{name}": 1}
    _close(list(ours), list(stock))


# ---------------------------------------------------------------------------------------
# unsupported options: strict raises, non-strict warns once and runs verl's
# ---------------------------------------------------------------------------------------


def test_unsupported_loss_mode_strict_and_fallback(monkeypatch, model_dir):
    """A loss mode the user registered in verl's registry (every one of verl's is fused)."""
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "my_loss", core_algos.compute_policy_loss_vanilla)
    cfg = _actor_config("my_loss")
    rk.apply(strict=True)
    with pytest.raises(NotImplementedError, match=r"config\.policy_loss\.loss_mode='my_loss'"):
        _train(monkeypatch, model_dir, cfg, entropy=False, steps=1)
    rk.unapply()
    stock = _train(monkeypatch, model_dir, _actor_config("my_loss"), entropy=False, steps=1)
    # verl's own log-probs too: the fallback is then bit for bit
    rk.apply(strict=False, logprobs=False, policy_loss=False)
    reset_call_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _train(monkeypatch, model_dir, _actor_config("my_loss"), entropy=False, steps=1)
    assert len([w for w in caught if "my_loss" in str(w.message)]) == 1  # once
    assert call_counts()["verl.ppo_loss[verl]"] == B // 2
    _close(ours[0], stock[0], tol=0)
    _close(ours[1], stock[1], tol=0)


def test_unsupported_option_of_a_dropin():
    rk.apply()
    h, w, y = torch.randn(5, 8), torch.randn(11, 8), torch.randint(0, 11, (5,))
    with pytest.raises(NotImplementedError, match="reduction"):
        verl_lce.linear_cross_entropy(h, w, y, 1.0, "mean")
    lp, ent = verl_lce.linear_cross_entropy(h, w, y)
    logits = h @ w.T
    _close(lp, verl_F.logprobs_from_logits_v2(logits, y), 1e-5)


def test_version_outside_tested_range(monkeypatch):
    monkeypatch.setattr(verl, "__version__", "0.8.3")
    with pytest.raises(PatchError, match="0.8.3"):
        rk.apply()
    assert not rk.is_applied()
    with pytest.warns(RuntimeWarning, match="0.8.3"):
        rk.apply(strict=False)
    assert rk.is_applied()


def test_moved_name_raises_before_patching(monkeypatch):
    before = dict(core_algos.POLICY_LOSS_REGISTRY)
    monkeypatch.delattr(verl_F, "entropy_from_logits")
    with pytest.raises(PatchError, match="entropy_from_logits"):
        rk.apply()
    assert not rk.is_applied()
    assert all(core_algos.POLICY_LOSS_REGISTRY[k] is v for k, v in before.items())


# ---------------------------------------------------------------------------------------
# unapply restores every object and the registries exactly
# ---------------------------------------------------------------------------------------


def _snapshot():
    mods = [core_algos, verl_F, verl_lce, verl_losses, ti]
    mods += [sys.modules[m] for m in ("verl.trainer.distillation.losses",) if m in sys.modules]
    attrs = {(m.__name__, a): v for m in mods for a, v in vars(m).items() if callable(v)}
    engine = ti.FSDPEngineWithLMHead
    attrs.update({(f"{ti.__name__}.{engine.__name__}", a): v for a, v in vars(engine).items() if callable(v)})
    return (
        attrs,
        dict(core_algos.POLICY_LOSS_REGISTRY),
        dict(core_algos.ADV_ESTIMATOR_REGISTRY),
    )


def test_unapply_restores_everything():
    # apply() imports verl's distillation losses (a user of ppo_loss by name): import it first,
    # so that the snapshots hold the same modules whichever tests ran before.
    importlib.import_module("verl.trainer.distillation.losses")
    before = _snapshot()
    rk.apply()
    assert rk.is_applied()
    during = _snapshot()
    changed = {k for k, v in before[0].items() if during[0][k] is not v}
    expected = {("verl.trainer.ppo.core_algos", rk_patch.POLICY_LOSSES[k][0]) for k in rk_patch.POLICY_LOSSES} | {
        ("verl.trainer.ppo.core_algos", rk_patch.ADV_ESTIMATORS[k][0]) for k in rk_patch.ADV_ESTIMATORS
    }
    expected |= {
        ("verl.utils.torch_functional", "logprobs_from_logits"),
        ("verl.utils.torch_functional", "entropy_from_logits"),
        ("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy"),
        ("verl.workers.utils.losses", "ppo_loss"),
        ("verl.workers.engine.fsdp.transformer_impl", "logprobs_from_logits"),
        ("verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead", "forward_step"),
    }
    expected.add(("verl.trainer.distillation.losses", "ppo_loss"))
    assert changed == expected, changed ^ expected
    assert set(during[1]) == set(before[1]) and set(during[2]) == set(before[2])  # verl's names, no new ones
    # a verl module imported while applied takes the patched function by name; unapply restores it too
    late = types.ModuleType("verl._rk_late_import")
    late.logprobs_from_logits = verl_F.logprobs_from_logits
    sys.modules[late.__name__] = late
    try:
        rk.unapply()
        assert not rk.is_applied()
        after = _snapshot()
        assert after[0].keys() == before[0].keys()
        assert all(after[0][k] is v for k, v in before[0].items())
        for i in (1, 2):
            assert after[i].keys() == before[i].keys()
            assert all(after[i][k] is v for k, v in before[i].items())
        assert late.logprobs_from_logits is before[0][("verl.utils.torch_functional", "logprobs_from_logits")]
    finally:
        del sys.modules[late.__name__]
    rk.unapply()  # a no-op


def test_apply_twice_then_unapply_is_stock():
    before = _snapshot()
    rk.apply(advantages=False)
    rk.apply(policy_loss=False)
    assert core_algos.POLICY_LOSS_REGISTRY["vanilla"] is before[1]["vanilla"]
    assert core_algos.ADV_ESTIMATOR_REGISTRY["grpo"] is not before[2]["grpo"]
    rk.unapply()
    after = _snapshot()
    assert all(after[0][k] is v for k, v in before[0].items())
    assert all(after[1][k] is v for k, v in before[1].items())
    assert all(after[2][k] is v for k, v in before[2].items())


def test_signatures_are_verls():
    """Every patched entry point takes verl's arguments (names, kinds, defaults)."""
    import inspect

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    rk.apply()
    patched = [core_algos.POLICY_LOSS_REGISTRY[k] for k in rk_patch.POLICY_LOSSES]
    patched += [core_algos.ADV_ESTIMATOR_REGISTRY[k] for k in rk_patch.ADV_ESTIMATORS]
    patched += [verl_losses.ppo_loss, verl_F.logprobs_from_logits, verl_F.entropy_from_logits]
    patched += [verl_lce.linear_cross_entropy, ti.FSDPEngineWithLMHead.forward_step]
    for fn in patched:
        original = fn.__wrapped_verl__
        if getattr(original, "__self__", None) is verl_lce.LinearCrossEntropy:  # Function.apply: forward, less ctx
            assert params(fn) == params(verl_lce.LinearCrossEntropy.forward)[1:]
        else:
            assert params(fn) == params(original), fn.__name__
