"""``integrations.verl.apply(logits_precision=, match_sampling=, rollout_config=,
mismatch_metrics=)``.

- ``match_sampling=True``: verl's ``logprobs_from_logits`` / ``entropy_from_logits`` /
  ``linear_cross_entropy`` (the module attributes verl's engine calls) score the rollout's
  kept set (``actor_rollout_ref.rollout``: top_k, top_p, the engine's convention) against a
  torch oracle (``testing.sampling.vllm_kept`` / ``sglang_kept``), also inside verl's FSDP
  engine on the CPU (``infer_batch``, verl's compute_log_prob); the default ``apply()`` is
  unchanged; bad settings raise naming them.
- ``mismatch_metrics=True``: verl's off-policy ``rollout_corr/*`` metrics from
  ``rollout_mismatch`` equal verl's own ``compute_offpolicy_metrics`` /
  ``compute_rollout_corr_metrics_from_logprobs`` / ``compute_rollout_correction_and_rejection_mask``
  on the same inputs.

The sampling support runs on the reference backend.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
import verl.trainer.ppo.rollout_corr_helper as verl_rch
import verl.utils.kernel.linear_cross_entropy as verl_lce_module
import verl.utils.torch_functional as verl_tf

# verl's engine tests' tiny Qwen2 (tests/ is on the import path: pyproject.toml)
from integrations.test_verl_apply import model_dir  # noqa: F401  (a fixture)
from verl.workers.engine.fsdp import transformer_impl as ti

from rlvr_kernels.integrations import verl as rk
from rlvr_kernels.integrations.verl import _head, _rollout_corr
from rlvr_kernels.testing import verl_engine
from rlvr_kernels.testing.dist import single_process_group
from rlvr_kernels.testing.sampling import sglang_kept, vllm_kept

BACKEND = "cpu"
KEPT = {"vllm": vllm_kept, "sglang": sglang_kept}


@pytest.fixture(autouse=True)
def _unapplied():
    yield
    rk.unapply()


def _oracle(logits, labels, kept_fn, **filters):
    """(log-probs over the engine's kept set with each row's label added, entropies over the
    kept set alone: verl's entropy_from_logits has no labels, whether a label lies outside)."""
    z = logits.double().reshape(-1, logits.shape[-1])
    kept = kept_fn(z, **filters)
    rows, flat = torch.arange(z.shape[0]), labels.reshape(-1)
    outside = ~kept[rows, flat]
    logp_all = torch.log_softmax(torch.where(kept, z, torch.full_like(z, -math.inf)), -1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1).reshape(labels.shape)
    kept[rows, flat] = True
    logp = torch.log_softmax(torch.where(kept, z, torch.full_like(z, -math.inf)), -1)[rows, flat].reshape(labels.shape)
    return logp, entropy, outside.reshape(labels.shape)


def _same(got, want, atol=1e-5):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=0, atol=atol)


@pytest.mark.parametrize("name", ["vllm", "sglang"])
@pytest.mark.parametrize("filters", [dict(top_k=4), dict(top_p=0.7), dict(top_k=6, top_p=0.8)])
def test_dropins_score_the_rollout_kept_set(name, filters):
    g = torch.Generator().manual_seed(len(str(filters)) + len(name))
    logits = 2 * torch.randn(5, 7, 23, generator=g)
    labels = torch.randint(0, 23, (5, 7), generator=g)
    want, want_h, outside = _oracle(logits, labels, KEPT[name], **filters)
    assert bool(outside.any()) and bool(torch.isfinite(want).all())
    rk.apply(match_sampling=True, rollout_config={"name": name, **filters})
    with rk.use_backend(BACKEND):
        _same(verl_tf.logprobs_from_logits(logits, labels), want)
        torch.testing.assert_close(verl_tf.entropy_from_logits(logits).double(), want_h, rtol=0, atol=1e-5)
        # linear_cross_entropy (use_fused_kernels): the same from hidden states and the head
        hidden = torch.randn(9, 8, generator=g)
        weight = torch.randn(23, 8, generator=g)
        targets = torch.randint(0, 23, (9,), generator=g)
        logp, entropy = verl_lce_module.linear_cross_entropy(hidden, weight, targets, 0.7)
    want, _, _ = _oracle((hidden.double() @ weight.double().T) / 0.7, targets, KEPT[name], **filters)
    _same(logp, want)
    # (linear_cross_entropy's entropy comes with the labels: over the kept set with them)
    z = (hidden.double() @ weight.double().T) / 0.7
    kept = KEPT[name](z, **filters)
    kept[torch.arange(9), targets] = True
    log_p = torch.log_softmax(torch.where(kept, z, -math.inf), -1)
    want_h = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(entropy.double(), want_h, rtol=0, atol=1e-5)
    rk.apply()  # the default: the full vocabulary, stock numbers
    with rk.use_backend(BACKEND):
        full = verl_tf.logprobs_from_logits(logits, labels)
    torch.testing.assert_close(full, torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0])


def test_logits_precision_bf16():
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(4, 31, generator=g)
    labels = torch.randint(0, 31, (4,), generator=g)
    rk.apply(logits_precision="bf16")
    with rk.use_backend(BACKEND):
        got = verl_tf.logprobs_from_logits(logits, labels)
    rounded = logits.to(torch.bfloat16).float()
    torch.testing.assert_close(got, torch.log_softmax(rounded, -1).gather(-1, labels[:, None])[:, 0])


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="rollout_config"):
        rk.apply(match_sampling=True)
    with pytest.raises(ValueError, match="rollout_config"):
        rk.apply(rollout_config={"name": "vllm"})
    with pytest.raises(NotImplementedError, match=r"rollout_config\.name"):
        rk.apply(match_sampling=True, rollout_config={"name": "hf", "top_k": 3})
    with pytest.raises(NotImplementedError, match="repetition_penalty"):
        rk.apply(match_sampling=True, rollout_config={"name": "vllm", "repetition_penalty": 1.1})
    with pytest.raises(NotImplementedError, match="do_sample"):
        rk.apply(match_sampling=True, rollout_config={"name": "vllm", "do_sample": False})
    with pytest.raises(ValueError, match=r"rollout_config\.top_p"):
        rk.apply(match_sampling=True, rollout_config={"name": "vllm", "top_p": 0.0})
    with pytest.raises(TypeError, match=r"rollout_config\.top_k"):
        rk.apply(match_sampling=True, rollout_config={"name": "vllm", "top_k": 2.5})
    with pytest.raises(ValueError, match="logits_precision"):
        rk.apply(logits_precision="tf32")
    with pytest.raises(TypeError, match="match_sampling"):
        rk.apply(match_sampling="yes")
    with pytest.raises(ValueError, match="match_sampling"):
        rk.apply(logprobs=False, match_sampling=True, rollout_config={"name": "vllm"})
    assert not rk.is_applied()
    # verl's RolloutConfig itself (an attribute object), filters off: the full vocabulary
    from verl.workers.config import RolloutConfig

    rk.apply(match_sampling=True, rollout_config=RolloutConfig(name="sglang"))
    assert _head.SAMPLING is None
    rk.unapply()
    assert (_head.LOGITS_PRECISION, _head.SAMPLING, _rollout_corr.MISMATCH_OP) == ("fp32", None, False)


def test_engine_compute_log_prob_on_the_kept_set(monkeypatch, model_dir):  # noqa: F811 (the fixture)
    """verl's FSDP engine (infer_batch, verl's compute_log_prob) on the CPU: under
    apply(match_sampling=True) its log-probs are the kept set's of the very logits verl's
    engine hands to logprobs_from_logits (captured in the stock run)."""
    V = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    with single_process_group():
        for obj, attr, value in verl_engine.device_patches("cpu"):
            monkeypatch.setattr(obj, attr, value)
        d = model_dir
        calls = []
        stock_fn = ti.logprobs_from_logits

        def spy(logits, labels, inplace_backward=True):
            calls.append((logits.detach().clone(), labels.clone()))
            return stock_fn(logits, labels, inplace_backward=inplace_backward)

        def infer():
            module = transformers.Qwen2ForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
            engine = verl_engine.build_engine(
                d, module, micro_batch_size=2, optimizer=lambda p: torch.optim.SGD(p, lr=1.0)
            )
            batch = verl_engine.rollout_batch(vocab=V, batch=4, prompt=3, response=5, seed=0)
            td = verl_engine.worker_batch(batch, micro_batch_size=2, entropy=False, train=False)
            with rk.use_backend(BACKEND):
                return engine.infer_batch(td)["model_output"]["log_probs"].values()

        monkeypatch.setattr(ti, "logprobs_from_logits", spy)
        stock = infer()
        monkeypatch.setattr(ti, "logprobs_from_logits", stock_fn)
        filters = dict(top_k=5, top_p=0.9)
        oracles = [_oracle(lg, lb, vllm_kept, **filters) for lg, lb in calls]
        want = torch.cat([o[0].reshape(-1) for o in oracles])
        outside = torch.cat([o[2].reshape(-1) for o in oracles])
        full = torch.cat([_oracle(lg, lb, vllm_kept)[0].reshape(-1) for lg, lb in calls])
        assert want.shape == stock.shape
        _same(stock, full)  # the captured calls are the engine's output, in its order
        rk.apply(match_sampling=True, rollout_config={"name": "vllm", **filters})
        ours = infer()
    assert bool(outside.any()) and bool(torch.isfinite(want).all())
    _same(ours, want)


# ------------------------------------------------------------------ mismatch_metrics


def _logprobs_case(seed=0, B=5, L=9):
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, L, generator=g)
    rollout = old + 0.2 * torch.randn(B, L, generator=g)
    mask = (torch.rand(B, L, generator=g) < 0.75).float()
    mask[3] = 0  # a sequence without a valid token
    mask[0, 0] = 1
    return old, rollout, mask


def _assert_metrics(got, want, rel=1e-5):
    assert list(got) == list(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=rel, abs=1e-6), k


def test_mismatch_metrics_are_verls():
    """apply(mismatch_metrics=True): verl's compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs and the rollout_corr/ off-policy part of
    compute_rollout_correction_and_rejection_mask, through the patched module, equal verl's
    own functions (kept by reference before apply) on the same inputs; and the fields come
    from rollout_mismatch (MISMATCH_OP set)."""
    stock = {
        "off": verl_rch.compute_offpolicy_metrics,
        "from_logprobs": verl_rch.compute_rollout_corr_metrics_from_logprobs,
        "both": verl_rch.compute_rollout_correction_and_rejection_mask,
    }
    rk.apply(mismatch_metrics=True)
    assert _rollout_corr.MISMATCH_OP is True
    for seed in range(3):
        old, rollout, mask = _logprobs_case(seed)
        with rk.use_backend("cpu"):
            _assert_metrics(verl_rch.compute_offpolicy_metrics(old, rollout, mask), stock["off"](old, rollout, mask))
            _assert_metrics(
                verl_rch.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask),
                stock["from_logprobs"](old, rollout, mask),
            )
            kw = dict(rollout_is="token", rollout_is_threshold=2.0)
            got = verl_rch.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kw)[2]
            want = stock["both"](old, rollout, mask, **kw)[2]
        assert set(got) == set(want)
        _assert_metrics(got, {k: want[k] for k in got})
        # without rollout log-probs: verl's formulas (the training perplexities only)
        _assert_metrics(verl_rch.compute_offpolicy_metrics(old, None, mask), stock["off"](old, None, mask))
    rk.unapply()
    assert _rollout_corr.MISMATCH_OP is False


def test_offpolicy_fields_come_from_rollout_mismatch(monkeypatch):
    """The mapped names are rollout_mismatch's fields (one call, every name)."""
    import rlvr_kernels.integrations.verl._rollout_corr as rc

    seen = []
    real = rc.rollout_mismatch

    def counted(*a, **k):
        seen.append(1)
        return real(*a, **k)

    monkeypatch.setattr(rc, "rollout_mismatch", counted)
    old, rollout, mask = _logprobs_case(7)
    monkeypatch.setattr(rc, "MISMATCH_OP", True)
    with rk.use_backend("cpu"):
        out = rc.offpolicy_metrics(old, rollout, mask)
    assert len(seen) == 1 and set(out) == set(rc.OFFPOLICY_FIELDS)


def test_ppo_loss_refuses_kl_loss_with_match_sampling():
    """The fused ppo_loss under match_sampling with actor.use_kl_loss raises (the reference
    log-probs would be restricted to the reference's own kept set)."""
    import verl.workers.utils.losses as verl_losses

    config = verl_engine.actor_config("vanilla", batch_size=4, micro_batch_size=2, use_kl_loss=True)
    rk.apply(match_sampling=True, rollout_config={"name": "vllm", "top_k": 4})
    with pytest.raises(NotImplementedError, match="use_kl_loss"):
        verl_losses.ppo_loss(config, None, None)
