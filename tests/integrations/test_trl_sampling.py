"""``integrations.trl.apply(logits_precision=, match_sampling=, mismatch_metrics=)`` on TRL
1.16's real ``GRPOTrainer`` (a tiny Qwen2 with a character tokenizer, in this process).

- ``match_sampling=True``: the log-probs and entropies the trainer computes
  (``_get_per_token_logps_and_entropies``, TRL's fused head) are those of the engine's kept
  set, against a torch oracle on the model's own logits (``testing.sampling.vllm_kept``);
  the reference model keeps the full vocabulary; one training step (transformers' generate
  with the same filters) stays finite; the settings the head cannot reproduce raise.
- the default ``apply()`` scores the full vocabulary, as before; ``logits_precision``
  reaches ``linear_logprobs``.
- ``mismatch_metrics=True``: TRL's ``sampling/sampling_logp_difference/*`` from
  ``rollout_mismatch`` equal TRL's own statements (run as TRL's text) on the same inputs,
  and inside ``_generate_and_score_completions`` (vLLM's generation faked: no vLLM here).

The sampling support runs on the reference backend (the C++ threshold kernels are not
required for these tests).
"""

from __future__ import annotations

import inspect
import math
import os
import tempfile

import pytest
import torch

from rlvr_kernels import linear_logprobs
from rlvr_kernels.integrations import trl as rk_trl
from rlvr_kernels.integrations._patch import call_counts, reset_call_counts
from rlvr_kernels.integrations.trl import _grpo_patch
from rlvr_kernels.testing.sampling import vllm_kept

BACKEND = "cpu"


# The GRPOTrainer runs' tokenizer, model, reward and config (tests/ is on the import path:
# pyproject.toml).
from integrations import trl_grpo_runner as RUNNER  # noqa: E402


@pytest.fixture(autouse=True)
def _unapplied():
    yield
    rk_trl.unapply()


TRAIN = dict(top_k=6, top_p=0.8, temperature=0.8, beta=0.04)


@pytest.fixture(scope="module")
def trainer():
    """One trainer for the whole module (building one takes seconds): beta > 0, so it has a
    reference model; each test puts back what it changes."""
    with tempfile.TemporaryDirectory() as tmp:
        yield _trainer(tmp, model_by_name=True, **TRAIN)


def _restore(trainer):
    trainer.top_k, trainer.top_p, trainer.min_p = TRAIN["top_k"], TRAIN["top_p"], None
    trainer.temperature = TRAIN["temperature"]
    _refresh_head(trainer)


def _trainer(tmp, *, model_by_name=False, **overrides):
    from datasets import Dataset
    from trl import GRPOTrainer

    tok = RUNNER.tokenizer()
    net = RUNNER.model(tok)
    model = net
    if model_by_name:  # TRL loads its reference model by name
        net.save_pretrained(os.path.join(tmp, "tiny"))
        tok.save_pretrained(os.path.join(tmp, "tiny"))
        model = os.path.join(tmp, "tiny")
    args = RUNNER.grpo_config(tmp, **{**RUNNER.BASE, "max_steps": 1, **overrides})
    return GRPOTrainer(
        model=model,
        reward_funcs=[RUNNER.reward_letters],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": RUNNER.PROMPTS}),
        processing_class=tok,
    )


def _batch(vocab, B=3, P=4, C=6, seed=0):
    """Left-padded prompts, right-padded completions: input ids, attention mask, C."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + C), generator=g)
    mask = torch.ones(B, P + C, dtype=torch.long)
    mask[0, :2] = 0  # prompt padding
    mask[1, -3:] = 0  # completion padding
    return ids, mask, C


def _oracle(trainer, model, ids, mask, C, **filters):
    """TRL's per-token log-probs and entropies from the model's own logits (its stock
    forward) in fp64, restricted to vLLM's kept set with each row's sampled token added
    (``filters``; none: full vocabulary); 0 where TRL masks. Also whether each token lies
    outside vLLM's kept set."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    z = logits[:, :-1] / trainer.temperature
    targets = ids[:, 1:]
    B, L, V = z.shape
    flat = z.reshape(-1, V)
    outside = torch.zeros(B, L, dtype=torch.bool)
    if filters:
        kept = vllm_kept(flat, **filters)
        rows = torch.arange(flat.shape[0])
        outside = ~kept[rows, targets.reshape(-1)].reshape(B, L)
        kept[rows, targets.reshape(-1)] = True
        flat = torch.where(kept, flat, torch.full_like(flat, -math.inf))
    logp_all = torch.log_softmax(flat, -1)
    logp = logp_all.gather(1, targets.reshape(-1, 1)).reshape(B, L)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1).reshape(B, L)
    valid = (mask[:, 1:] != 0).double()
    logp = torch.where(valid.bool(), logp, torch.zeros_like(logp))
    entropy = entropy * valid
    return logp[:, -C:], entropy[:, -C:], valid[:, -C:].bool(), outside[:, -C:]


def _scored(trainer, model, ids, mask, C, entropy=True):
    with torch.no_grad(), rk_trl.use_backend(BACKEND):
        logp, h, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C, compute_entropy=entropy)
    return logp.double(), None if h is None else h.double()


def _assert_logps(got, want, valid, atol=2e-5):
    g, w = got[valid], want[valid]
    assert torch.equal(torch.isneginf(g), torch.isneginf(w))
    finite = torch.isfinite(w)
    torch.testing.assert_close(g[finite], w[finite], rtol=0, atol=atol)


FILTERS = [
    dict(top_k=5),
    dict(top_p=0.6),
    dict(top_k=8, top_p=0.7, temperature=0.7),
    dict(min_p=0.95, temperature=0.3),
]


def test_match_sampling_logprobs_are_the_kept_sets(trainer):
    """Every filter of GRPOConfig, with transformers' generate (use_vllm=False): TRL's
    log-probs and entropies under apply(match_sampling=True) are the kept set's (targets
    outside it −inf); the default apply() gives the full vocabulary's."""
    try:
        model = trainer.model
        ids, mask, C = _batch(model.config.vocab_size)
        for case in FILTERS:
            filters = {k: v for k, v in case.items() if k != "temperature"}
            trainer.temperature = case.get("temperature", 1.0)
            # TRL's head reads the temperature it was built with; rebuild it as TRL's __init__ does.
            trainer.top_k, trainer.top_p, trainer.min_p = filters.get("top_k", 0), filters.get("top_p", 1.0), None
            trainer.min_p = filters.get("min_p")
            _refresh_head(trainer)
            rk_trl.apply(match_sampling=True)
            got, got_h = _scored(trainer, model, ids, mask, C)
            want, want_h, valid, outside = _oracle(trainer, model, ids, mask, C, **filters)
            assert bool(outside[valid].any()), case  # some targets fall outside vLLM's kept set: they join it
            _assert_logps(got, want, valid)
            assert bool(torch.isfinite(got[valid]).all())
            torch.testing.assert_close(got_h[valid], want_h[valid], rtol=0, atol=2e-5)

            rk_trl.apply()  # the default: full vocabulary, whatever the trainer's filters
            got, got_h = _scored(trainer, model, ids, mask, C)
            want, want_h, valid, _ = _oracle(trainer, model, ids, mask, C)
            _assert_logps(got, want, valid)
            torch.testing.assert_close(got_h[valid], want_h[valid], rtol=0, atol=2e-5)
    finally:
        _restore(trainer)


def _refresh_head(trainer):
    from trl.trainer.utils import add_fused_lm_head

    model = trainer.model
    model.forward = type(model).forward.__get__(model)  # drop the previous fused head
    add_fused_lm_head(model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))


def test_match_sampling_trains_and_reference_keeps_full_vocabulary(trainer):
    """One GRPOTrainer step with top-k / top-p under apply(match_sampling=True): the
    completions transformers sampled lie in the head's kept set (finite loss and metrics);
    the reference model (beta > 0) is scored on the full vocabulary."""
    rk_trl.apply(match_sampling=True, count_calls=True)
    reset_call_counts()
    with rk_trl.use_backend(BACKEND):
        trainer.train()
    logs = trainer.state.log_history[0]
    for key in ("loss", "entropy", "kl"):
        assert math.isfinite(logs[key]), (key, logs)
    assert call_counts().get("trl.kernels.ChunkedLogProbFunction", 0) > 0

    ids, mask, C = _batch(trainer.model.config.vocab_size, seed=1)
    got, _ = _scored(trainer, trainer.ref_model, ids, mask, C, entropy=False)
    want, _, valid, _ = _oracle(trainer, trainer.ref_model, ids, mask, C)
    _assert_logps(got, want, valid)
    policy, _ = _scored(trainer, trainer.model, ids, mask, C)
    kept, _, _, _ = _oracle(trainer, trainer.model, ids, mask, C, top_k=trainer.top_k, top_p=trainer.top_p)
    _assert_logps(policy, kept, valid)  # the policy's is the kept set's (with the sampled token)


def test_reference_adapter_marks_the_reference():
    """TRL's use_adapter (the PEFT reference) is wrapped so the block inside it is scored on
    the full vocabulary; the wrapper is TRL's context manager otherwise."""
    entered = []

    import contextlib

    @contextlib.contextmanager
    def use_adapter(model, adapter_name):
        entered.append((model, adapter_name))
        yield

    wrapped = _grpo_patch._reference_adapter(use_adapter)
    assert _grpo_patch._IN_REFERENCE[0] == 0
    with wrapped("m", adapter_name=None):
        assert _grpo_patch._IN_REFERENCE[0] == 1
    assert _grpo_patch._IN_REFERENCE[0] == 0 and entered == [("m", None)]


def test_logits_precision_reaches_the_head(trainer):
    """apply(logits_precision="bf16"): TRL's log-probs are linear_logprobs' bf16 logits."""
    model = trainer.model
    ids, mask, C = _batch(model.config.vocab_size)
    rk_trl.apply(logits_precision="bf16")
    got, _ = _scored(trainer, model, ids, mask, C)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        targets = ids[:, 1:]
        want = linear_logprobs(
            hidden.reshape(-1, hidden.shape[-1]),
            model.lm_head.weight,
            targets.reshape(-1),
            temperature=trainer.temperature,
            logits_precision="bf16",
            backend=BACKEND,
        ).logp.reshape(targets.shape)[:, -C:]
    valid = mask[:, 1:][:, -C:] != 0
    torch.testing.assert_close(got[valid], want.double()[valid], rtol=0, atol=1e-6)
    rk_trl.apply()
    fp32, _ = _scored(trainer, model, ids, mask, C)
    assert not torch.equal(fp32[valid], got[valid])


def test_match_sampling_refusals(trainer):
    """What the head cannot reproduce raises NotImplementedError naming the setting, a bad
    value ValueError naming the field, at the first log-prob call; a head call outside the
    trainer (no settings in reach) raises too."""
    model = trainer.model
    ids, mask, C = _batch(model.config.vocab_size)
    rk_trl.apply(match_sampling=True)
    cases = [
        (dict(repetition_penalty=1.1), NotImplementedError, "repetition_penalty"),
        (dict(top_p=0.9, min_p=0.1), NotImplementedError, "min_p"),
        (dict(repetition_penalty=1.0, top_p=1.0, min_p=0.1, use_vllm=True), None, None),
        (dict(top_p=1.5), ValueError, "GRPOConfig.top_p"),
        (dict(min_p=-0.1), ValueError, "GRPOConfig.min_p"),
        (dict(top_k=2.5), TypeError, "GRPOConfig.top_k"),
    ]
    for attrs, error, name in cases:
        saved = {k: getattr(trainer, k) for k in attrs}
        for k, v in attrs.items():
            setattr(trainer, k, v)
        if error is None:  # vLLM applies min-p before top-p: supported
            _scored(trainer, model, ids, mask, C)
        else:
            with pytest.raises(error, match=name.replace(".", r"\.")):
                _scored(trainer, model, ids, mask, C)
        for k, v in saved.items():
            setattr(trainer, k, v)
    trainer.args.generation_kwargs = {"top_k": 3}
    with pytest.raises(NotImplementedError, match=r"generation_kwargs\['top_k'\]"):
        _scored(trainer, model, ids, mask, C)
    trainer.args.generation_kwargs = None
    labels = ids.masked_fill(mask == 0, -100)
    with pytest.raises(NotImplementedError, match="not under GRPOTrainer"):
        with rk_trl.use_backend(BACKEND):
            model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)


# ------------------------------------------------------------------ mismatch_metrics


def _trl_statements():
    from trl.trainer.grpo_trainer import GRPOTrainer

    lines, _ = inspect.getsourcelines(GRPOTrainer._generate_and_score_completions)
    return _grpo_patch.original_block_source(lines, "_generate_and_score_completions", _grpo_patch.SAMPLING_DIFF)


def _mismatch_case(seed, B=4, T=7, tool=False, empty=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    sampling = old + 0.3 * torch.randn(B, T, generator=g)
    sampling[0, 1] = float("nan")  # vLLM could not score it
    sampling[2, 0] = float("nan")
    old[1, 2] = float("-inf")  # a target outside the training-side support
    completion_mask = (torch.rand(B, T, generator=g) < 0.8).long()
    if empty:
        completion_mask.zero_()
    tool_mask = (torch.rand(B, T, generator=g) < 0.7).long() if tool else None
    return old, sampling, completion_mask, tool_mask


@pytest.mark.parametrize("tool,empty", [(False, False), (True, False), (False, True)])
def test_sampling_logp_difference_is_trls(tool, empty):
    """Our replacement of TRL's five statements against TRL's own text run on the same
    inputs (NaN sampling log-probs, a −inf training log-prob, tool masks, nothing valid)."""
    old, sampling, completion_mask, tool_mask = _mismatch_case(3, tool=tool, empty=empty)
    scope = dict(
        torch=torch,
        old_per_token_logps=old,
        sampling_per_token_logps=sampling,
        completion_mask=completion_mask,
        tool_mask=tool_mask,
        device=old.device,
    )
    exec(_trl_statements(), scope)
    with rk_trl.use_backend("cpu"):
        mean, mx, mask = _grpo_patch.sampling_logp_difference(old, sampling, completion_mask, tool_mask)
    assert torch.equal(mask, scope["mask"])
    assert mean.dtype == scope["mean_delta"].dtype and mean.shape == ()
    torch.testing.assert_close(mean, scope["mean_delta"], rtol=1e-6, atol=0)
    assert torch.equal(mx, scope["max_delta"])
    if not empty:  # the −inf training log-prob on a valid token: inf in both
        assert math.isinf(float(mx)) == math.isinf(float(scope["max_delta"]))


def test_mismatch_metrics_inside_generate_and_score(trainer):
    """TRL's _generate_and_score_completions with vLLM's generation faked (its completions and
    sampling log-probs, two of them NaN): the sampling_logp_difference metrics of the method
    rewritten by apply(mismatch_metrics=True) equal stock TRL's; the IS-ratio metrics, not
    mapped, are TRL's own code either way."""
    saved = trainer.use_vllm, trainer.vllm_importance_sampling_correction, vars(trainer).get("_generate")
    try:
        tok = trainer.processing_class
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
        inputs = [{"prompt": p} for p in RUNNER.PROMPTS[:4] for _ in range(1)]
        g = torch.Generator().manual_seed(5)

        prompt_ids = [tok(p["prompt"])["input_ids"] for p in inputs]
        completion_ids = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (5, 3, 6, 4)]
        logps = [(-torch.rand(len(c), generator=g) * 2).tolist() for c in completion_ids]
        logps[0][2] = None  # vLLM's NaN
        logps[2][0] = None

        def fake_generate(prompts):
            texts = tok.batch_decode(completion_ids)
            return prompt_ids, completion_ids, None, texts, logps, {}, None, None

        trainer._generate = fake_generate
        names = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")
        others = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean")
        results = {}
        split = "train" if trainer.model.training else "eval"  # where TRL files the metrics
        for mode in ("stock", "applied"):
            if mode == "applied":
                rk_trl.apply(mismatch_metrics=True, count_calls=True)
                reset_call_counts()
            trainer._metrics[split].clear()
            with torch.no_grad(), rk_trl.use_backend(BACKEND):
                trainer._generate_and_score_completions(inputs)
            results[mode] = {k: list(trainer._metrics[split][k]) for k in names + others}
        assert call_counts().get(_grpo_patch.CALL_SAMPLING_METRICS) == 1
        for k in names:
            assert len(results["stock"][k]) == 1 and math.isfinite(results["stock"][k][0])
            assert results["applied"][k][0] == pytest.approx(results["stock"][k][0], rel=1e-6, abs=0)
        for k in others:  # TRL's code on old log-probs from our head (fp32 rounding apart)
            assert results["applied"][k] == pytest.approx(results["stock"][k], rel=1e-5, abs=0)
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = saved[:2]
        del trainer._generate
