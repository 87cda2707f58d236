"""The TRL integration's contract beyond the numbers (those are in tests/*/test_peers*.py
and tests/integrations/test_trl_suite.py): TRL's output dtypes on both of its paths, row
masks, outputs safe to modify in place, errors that name the caller's (TRL's) arguments,
options that are not fused raising instead of being ignored, and ``use_backend``."""

from __future__ import annotations

import contextlib
import itertools
import random
import re
import types

import pytest
import torch
import trl.trainer.utils as trl_utils
from _backends import FAST

from rlvr_kernels.integrations import trl as ours
from rlvr_kernels.integrations.trl import trainer_utils

# ---------------------------------------------------------------------------------------
# TRL's output dtypes
# ---------------------------------------------------------------------------------------


class FakeTensor:
    """What TRL's ``_supports_trl_loss_kernel`` reads of a tensor, on any device type."""

    def __init__(self, shape, dtype, device="cuda", strides=None):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.ndim = len(shape)
        self._strides = strides or torch.empty(shape, device="meta").stride()

    def stride(self, d=None):
        return self._strides if d is None else self._strides[d]


def _fakes(seed: int, n: int):
    rng = random.Random(seed)
    devices = ["cuda", "xpu", "cpu"]
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    for _ in range(n):
        lead = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 3)))
        vocab = rng.choice([0, 5])
        shape = lead + (vocab,)
        strides = torch.empty(shape, device="meta").stride()
        if rng.random() < 0.2:
            strides = strides[:-1] + (2,)
        logits = FakeTensor(shape, rng.choice(dtypes), rng.choice(devices), strides)
        index = row_mask = None
        if rng.random() < 0.8:
            ishape = rng.choice([lead, lead + (2,), lead[1:]])
            index = FakeTensor(ishape, rng.choice([torch.int32, torch.int64, torch.int16]), rng.choice(devices))
            if rng.random() < 0.6:
                mshape = rng.choice([ishape, ishape[1:], lead])
                mdtype = rng.choice([torch.bool, torch.int32, torch.int64, torch.float32, torch.uint8])
                row_mask = FakeTensor(mshape, mdtype, rng.choice(devices))
        elif rng.random() < 0.3:
            row_mask = FakeTensor(lead, torch.bool, logits.device.type)
        yield logits, index, row_mask


def test_kernel_predicate_is_trls():
    """Our copy of TRL's ``_supports_trl_loss_kernel`` decides as TRL's on every kind of
    input (fake tensors: the predicate reads only metadata, so CUDA/XPU cases run here)."""
    seen = set()
    for logits, index, row_mask in _fakes(0, 3000):
        want = trl_utils._supports_trl_loss_kernel(logits, index, row_mask)
        assert trainer_utils._kernel_supports(logits, index, row_mask) == want
        seen.add(want)
    assert seen == {True, False}


@pytest.mark.parametrize("triton", [True, False])
def test_output_dtypes_follow_trls_path(monkeypatch, triton):
    """fp32 where TRL's Triton kernel would run, the logits' dtype where its torch code
    would; ``selective_log_softmax_and_entropy`` decides for each output as TRL's torch
    path does (its entropy is ``entropy_from_logits`` of the scaled logits)."""
    monkeypatch.setattr(trainer_utils, "_TRITON_INSTALLED", triton)
    f32, bf16 = torch.float32, torch.bfloat16
    lg = FakeTensor((2, 3, 5), bf16)
    idx = FakeTensor((2, 3), torch.int64)
    assert trainer_utils._and_entropy_dtypes(lg, idx, 1.0, None) == ((f32, f32) if triton else (bf16, bf16))
    # a float row mask: TRL's kernel refuses it, its torch path computes the entropy with the kernel
    mask = FakeTensor((2, 3), torch.float32)
    assert trainer_utils._and_entropy_dtypes(lg, idx, 0.7, mask) == ((bf16, f32) if triton else (bf16, bf16))
    # K ids per position: the torch path for both, the entropy again through the kernel
    kidx = FakeTensor((2, 3, 4), torch.int64)
    assert trainer_utils._and_entropy_dtypes(lg, kidx, 1.0, None) == ((bf16, f32) if triton else (bf16, bf16))
    # a strided last dimension: refused as is; ``logits / T`` is contiguous again (sliced vocabulary)
    strided = FakeTensor((2, 3, 5), bf16, strides=(30, 10, 2))
    assert trainer_utils._and_entropy_dtypes(strided, idx, 1.0, None) == (bf16, bf16)
    assert trainer_utils._and_entropy_dtypes(strided, idx, 0.7, None) == ((f32, f32) if triton else (bf16, bf16))
    # fp64 never goes to TRL's kernel; CPU tensors neither
    assert trainer_utils._and_entropy_dtypes(FakeTensor((2, 3, 5), torch.float64), idx, 1.0, None) == (
        torch.float64,
        torch.float64,
    )
    cpu = FakeTensor((2, 3, 5), bf16, "cpu")
    assert trainer_utils._and_entropy_dtypes(cpu, FakeTensor((2, 3), torch.int64, "cpu"), 1.0, None) == (bf16, bf16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_output_dtypes_equal_trls_here(dtype):
    """On this machine's tensors, every output has the dtype of TRL's."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 9, generator=gen).to(dtype)
    index = torch.randint(0, 9, (3, 4), generator=gen)
    mask = torch.rand(3, 4, generator=gen) > 0.3
    for fn, args in (
        ("selective_log_softmax", (logits, index)),
        ("selective_log_softmax", (logits, index[..., None].expand(3, 4, 2))),
        ("entropy_from_logits", (logits,)),
        ("selective_log_softmax_and_entropy", (logits, index, True, 0.5, mask)),
    ):
        mine, theirs = getattr(ours, fn)(*args), getattr(trl_utils, fn)(*args)
        for a, b in zip(*(((x,) if isinstance(x, torch.Tensor) else x) for x in (mine, theirs))):
            assert a.dtype == b.dtype and a.shape == b.shape, fn


# ---------------------------------------------------------------------------------------
# Masks, in-place edits, K ids
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,device", FAST)
def test_masked_rows_are_zero_with_no_gradient(backend, device):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 13, generator=gen).to(device).requires_grad_(True)
    index = torch.randint(0, 13, (3, 5), generator=gen).to(device)
    mask = torch.rand(3, 5, generator=gen).to(device) > 0.4
    with ours.use_backend(backend):
        lp, ent = ours.selective_log_softmax_and_entropy(logits, index, row_mask=mask.long())
    assert not lp[~mask].any() and not ent[~mask].any() and ent[mask].gt(0).all()
    (lp.sum() + ent.sum()).backward()
    assert not logits.grad[~mask].any() and logits.grad[mask].abs().sum(-1).gt(0).all()


@pytest.mark.parametrize("fn", ["selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_can_be_modified_in_place(fn, dtype):
    """TRL's callers mask outputs in place before the backward (``logprobs[~mask] = 0``);
    every output of ours is its own tensor, never one the op saved for its backward."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 11, generator=gen).to(dtype).requires_grad_(True)
    index = torch.randint(0, 11, (2, 4), generator=gen)
    args = (logits,) if fn == "entropy_from_logits" else (logits, index)
    outs = getattr(ours, fn)(*args)
    outs = (outs,) if isinstance(outs, torch.Tensor) else outs
    for out in outs:
        out[0, 1] = 0.0
    sum(o.float().sum() for o in outs).backward()
    assert torch.isfinite(logits.grad).all()


def test_multi_index_reads_each_row_once_and_matches_the_log_softmax(monkeypatch):
    """K ids: equal to the gathered log-softmax for every K (including 0 and ids repeated
    within a row), one op call whatever K."""
    calls = []
    real = trainer_utils.logprobs_from_logits
    monkeypatch.setattr(trainer_utils, "logprobs_from_logits", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 17, generator=gen, dtype=torch.float64, requires_grad=True)
    for k in (0, 1, 3, 17):
        index = torch.randint(0, 17, (2, 3, k), generator=gen)
        if k > 1:
            index[..., 1] = index[..., 0]
        got = ours.selective_log_softmax(logits, index, temperature=0.9)
        want = (logits / 0.9).log_softmax(-1).gather(-1, index)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        up = torch.randn(index.shape, generator=gen, dtype=torch.float64)
        (g,) = torch.autograd.grad((got * up).sum(), logits, allow_unused=True)
        (w,) = torch.autograd.grad((want * up).sum(), logits)
        torch.testing.assert_close(torch.zeros_like(w) if g is None else g, w, rtol=1e-12, atol=1e-12)
    assert len(calls) == 4


# ---------------------------------------------------------------------------------------
# Errors name the caller's arguments
# ---------------------------------------------------------------------------------------

# The inner ops' argument names, which a TRL caller never passed (as whole words; ``mask``,
# ``entropy`` and ``scale`` are prose too: the message's first word is checked for those).
INNER = re.compile(
    r"(?<![\w.])(targets|logprobs|old_logprobs|ref_logprobs|scores|group_size|clip_low|clip_high|clip_ratio_c|"
    r"kl_coef|tau_pos|tau_neg|global_num_tokens|global_num_seqs|loss_scale_factor|entropy_quantile)\b"
)

L = torch.randn(2, 3, 11)
IDX = torch.randint(0, 11, (2, 3))
R = torch.randn(8, 2)
B, T = 4, 6
LP = torch.randn(B, T)
M = torch.ones(B, T)
A = torch.randn(B)


def _loss(**kw):
    """A grpo_loss_trl call (bnpo unless ``kw`` says otherwise) with ``kw`` replacing arguments."""
    tensors = dict(per_token_logps=LP, old_per_token_logps=LP, advantages=A, completion_mask=M)
    options = dict(loss_type="bnpo")
    for k, v in kw.items():
        (tensors if k in tensors else options)[k] = v
    return lambda: ours.grpo_loss_trl(*tensors.values(), **options)


ERRORS = [
    # (call, exception, the argument the message must start with)
    (lambda: ours.selective_log_softmax(L, IDX[:, :2]), ValueError, "index"),
    (lambda: ours.selective_log_softmax(L, IDX.float()), TypeError, "index"),
    (lambda: ours.selective_log_softmax(L, IDX + 11), ValueError, "index"),
    (lambda: ours.selective_log_softmax(L, torch.full_like(IDX, -100)), ValueError, "index"),
    (lambda: ours.selective_log_softmax(L, IDX, row_mask=torch.ones(2, 3, 1)), ValueError, "row_mask"),
    (lambda: ours.selective_log_softmax(L, IDX, 0.0), ValueError, "temperature"),
    (lambda: ours.selective_log_softmax(L.long(), IDX), TypeError, "logits"),
    (lambda: ours.selective_log_softmax_and_entropy(L, IDX, False, -1.0), ValueError, "temperature"),
    (lambda: ours.selective_log_softmax_and_entropy(L, IDX.to(torch.int16)), TypeError, "index"),
    (lambda: ours.entropy_from_logits(torch.randn(3, 0)), ValueError, "logits"),
    (lambda: ours.compute_grpo_advantages(R, 3), ValueError, "num_generations"),
    (lambda: ours.compute_grpo_advantages(R, 0), ValueError, "num_generations"),
    (lambda: ours.compute_grpo_advantages(R.long(), 4), TypeError, "rewards_per_func"),
    (lambda: ours.compute_grpo_advantages(R, 4, reward_weights=torch.ones(3)), ValueError, "reward_weights"),
    (lambda: ours.compute_grpo_advantages(R, 4, scale_rewards="x"), ValueError, "scale_rewards"),
    (lambda: ours.compute_grpo_advantages(R, 4, multi_objective_aggregation="x"), ValueError, "multi_objective"),
    (lambda: ours.compute_async_grpo_advantages(R, 3), ValueError, "num_generations"),
    (lambda: ours.compute_async_grpo_advantages(R.long(), 4), TypeError, "rewards_per_func"),
    (_loss(importance_sampling_ratio=torch.ones(T)), ValueError, "importance_sampling_ratio"),
    (_loss(importance_sampling_ratio=torch.ones(B, T + 1)), ValueError, "importance_sampling_ratio"),
    (_loss(importance_sampling_ratio=-torch.ones(B, 1)), ValueError, "importance_sampling_ratio"),
    (_loss(per_token_logps=LP[0]), ValueError, "per_token_logps"),
    (_loss(old_per_token_logps=LP[:, :2]), ValueError, "old_per_token_logps"),
    (_loss(old_per_token_logps=LP.long()), TypeError, "old_per_token_logps"),
    (_loss(old_per_token_logps=LP * float("nan")), ValueError, "old_per_token_logps"),
    (_loss(completion_mask=M[:, :2]), ValueError, "completion_mask"),
    (_loss(advantages=A[:2]), ValueError, "advantages"),
    (_loss(beta=0.1, use_bias_correction_kl=False), ValueError, "ref_per_token_logps"),
    (_loss(beta=0.1, use_bias_correction_kl=False, ref_per_token_logps=LP[:1]), ValueError, "ref_per_token_logps"),
    (_loss(entropies=LP[:, :1]), ValueError, "entropies"),
    (_loss(entropy_coef=0.1), ValueError, "entropies"),
    (_loss(epsilon_low=1.5), ValueError, "epsilon_low"),
    (_loss(epsilon_high=-2.0), ValueError, "epsilon_high"),
    (_loss(loss_type="sapo", sapo_temperature_pos=-1.0), ValueError, "sapo_temperature_pos"),
    (_loss(top_entropy_quantile=0.0, entropies=LP), ValueError, "top_entropy_quantile"),
    (_loss(gradient_accumulation_steps=0), ValueError, "gradient_accumulation_steps"),
    (_loss(num_processes=0), ValueError, "num_processes"),
    (_loss(loss_type="dr_grpo"), ValueError, "max_completion_length"),
    (_loss(loss_type="dapo"), ValueError, "num_items_in_batch"),
    (_loss(loss_type="dapo", num_items_in_batch=torch.ones(3)), ValueError, "num_items_in_batch"),
    (_loss(loss_type="foo"), ValueError, "loss_type"),
    (_loss(importance_sampling_level="seq"), ValueError, "importance_sampling_level"),
    (_loss(backend="nope"), ValueError, "backend"),
]


@pytest.mark.parametrize("k", range(len(ERRORS)))
def test_errors_name_the_callers_argument(k):
    call, exc, name = ERRORS[k]
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(name), message
    assert not INNER.search(message), message


def test_wrongly_shaped_ratio_is_a_shape_error_even_when_it_broadcasts():
    """The ratio's shape is checked before its values are read: [B] with B == T, [T, B]."""
    lp, m = torch.randn(5, 5), torch.ones(5, 5)
    for bad in (torch.ones(1, 5), torch.ones(5, 2), torch.ones(5, 5, 1)):
        with pytest.raises(ValueError, match="^importance_sampling_ratio: expected"):
            ours.grpo_loss_trl(lp, lp, torch.randn(5), m, loss_type="bnpo", importance_sampling_ratio=bad)


# ---------------------------------------------------------------------------------------
# A loss over zero tokens
# ---------------------------------------------------------------------------------------

ZERO_TOKEN_OPTIONS = {
    "plain": {},
    "beta": dict(beta=0.04, use_bias_correction_kl=True),
    "beta, plain KL": dict(beta=0.04, use_bias_correction_kl=False),
    "entropy_coef": dict(entropy_coef=0.1),
    "top_entropy_quantile": dict(top_entropy_quantile=0.5),
    "importance_sampling_ratio": dict(importance_sampling_ratio="ones"),
    "off_policy_mask_threshold": dict(off_policy_mask_threshold=0.1),
    "token advantages": dict(advantages="tokens"),
}


@pytest.mark.parametrize("batch", [0, 3], ids=["empty batch", "all masked"])
@pytest.mark.parametrize("options", list(ZERO_TOKEN_OPTIONS))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ours.TRL_LOSS_TYPES)
def test_a_loss_over_zero_tokens_is_zero_with_zero_gradient(loss_type, level, options, batch):
    """No valid token (an empty batch, or every token masked): the loss is 0 with a zero
    gradient and every metric is a number, at both importance-sampling levels (TRL's own
    mean over no sequence is NaN). Only the nanmin / nanmax TRL metrics may be NaN, where
    this process has no value to take an extremum over (the cross-process reduction skips
    it)."""
    B, T = batch, 5
    logps = torch.randn(B, T).requires_grad_(True)
    entropies = torch.rand(B, T).requires_grad_(True)
    kw = dict(ZERO_TOKEN_OPTIONS[options])
    advantages = torch.randn(B, T) if kw.pop("advantages", None) == "tokens" else torch.randn(B)
    if kw.get("importance_sampling_ratio") == "ones":
        kw["importance_sampling_ratio"] = torch.ones(B, T)
    if "beta" in kw:
        kw["ref_per_token_logps"] = torch.randn(B, T)
    loss, metrics, trl_metrics = ours.grpo_loss_trl(
        logps,
        logps.detach() + 0.1,
        advantages,
        torch.zeros(B, T),
        loss_type=loss_type,
        importance_sampling_level=level,
        entropies=entropies,
        max_completion_length=T,
        num_items_in_batch=0,
        return_trl_metrics=True,
        **kw,
    )
    assert float(loss.detach()) == 0.0
    loss.backward()
    for leaf in (logps, entropies):
        assert leaf.grad is None or bool((leaf.grad == 0).all())
    for name, value in metrics._asdict().items():
        assert value is None or bool(torch.isfinite(value).all()), name
    # (At sequence level TRL has a ratio per sequence, empty ones included: 1, never clipped.)
    has_extremum = batch > 0 and level == "sequence" and advantages.dim() == 1
    for name, metric in trl_metrics.items():
        if metric.reduce in ("nanmin", "nanmax") and not has_extremum:
            assert bool(torch.isnan(metric.value)), name
        else:
            assert bool(torch.isfinite(metric.value).all()), name


# ---------------------------------------------------------------------------------------
# Options that are not fused raise; nothing is ignored
# ---------------------------------------------------------------------------------------


def test_bias_corrected_kl_is_the_default():
    """TRL's default ``use_bias_correction_kl=True`` multiplies the KL by the importance
    ratio (fused: the op's kl_ratio_correction); without a KL term it changes nothing.
    Values against TRL's own code: tests/policy_loss/test_peers_trl.py."""
    gen = torch.Generator().manual_seed(5)
    lp = torch.randn(B, T, generator=gen)
    old = lp + 0.1 * torch.randn(B, T, generator=gen)
    ref = lp + 0.1 * torch.randn(B, T, generator=gen)
    args = (lp, old, torch.randn(B, generator=gen), M)
    kw = dict(loss_type="bnpo", beta=0.04, ref_per_token_logps=ref)
    default, m_default = ours.grpo_loss_trl(*args, **kw)
    plain, m_plain = ours.grpo_loss_trl(*args, **kw, use_bias_correction_kl=False)
    ratio = (lp - old).exp()
    k3 = (ref - lp).exp() - (ref - lp) - 1
    valid = M.bool()
    assert float(m_default.kl) == pytest.approx(float((k3 * ratio)[valid].mean()), rel=1e-5)
    assert float(m_plain.kl) == pytest.approx(float(k3[valid].mean()), rel=1e-5)
    assert not torch.equal(default, plain)
    off, _ = ours.grpo_loss_trl(*args, loss_type="bnpo", use_bias_correction_kl=False)
    on, _ = ours.grpo_loss_trl(*args, loss_type="bnpo")
    assert torch.equal(on, off)


def test_off_policy_mask_drops_negative_off_policy_sequences():
    """TRL's off-policy sequence mask: a sequence with A < 0 whose mean KL to the sampling
    policy exceeds the threshold loses its pg term (values: test_peers_trl.py)."""
    adv = torch.tensor([-1.0] * B)
    old = LP - 0.5  # mean KL old − logp = −0.5: kept at threshold 0; dropped at −1
    kept, _ = ours.grpo_loss_trl(LP, old, adv, M, loss_type="bnpo", off_policy_mask_threshold=0.0)
    plain, _ = ours.grpo_loss_trl(LP, old, adv, M, loss_type="bnpo")
    dropped, _ = ours.grpo_loss_trl(LP, old, adv, M, loss_type="bnpo", off_policy_mask_threshold=-1.0)
    assert torch.equal(kept, plain) and float(dropped) == 0.0 and float(plain) != 0.0


# ---------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------


def test_every_trl_function_runs_on_the_use_backend_one(monkeypatch):
    """The drop-ins take no ``backend`` argument (TRL's signatures): each runs the ops on
    the backend of the innermost ``use_backend`` block; ``grpo_loss_trl(backend=None)``
    too, and its own ``backend=`` wins."""
    from rlvr_kernels.integrations.trl import _grpo_loss, async_rollout_worker, grpo_trainer

    seen = []

    def spy(real):
        def op(*args, backend="auto", **kw):
            seen.append(backend)
            return real(*args, backend=backend, **kw)

        return op

    monkeypatch.setattr(trainer_utils, "logprobs_from_logits", spy(trainer_utils.logprobs_from_logits))
    monkeypatch.setattr(grpo_trainer, "group_advantages", spy(grpo_trainer.group_advantages))
    monkeypatch.setattr(_grpo_loss, "policy_loss", spy(_grpo_loss.policy_loss))
    monkeypatch.setattr(async_rollout_worker, "group_advantages", spy(async_rollout_worker.group_advantages))
    calls = [
        lambda: ours.selective_log_softmax(L, IDX),
        lambda: ours.selective_log_softmax(L, IDX[..., None]),
        lambda: ours.entropy_from_logits(L),
        lambda: ours.selective_log_softmax_and_entropy(L, IDX),
        lambda: ours.compute_grpo_advantages(R, 4),
        lambda: ours.compute_async_grpo_advantages(R, 4),
        lambda: ours.grpo_loss_trl(LP, LP, A, M, loss_type="bnpo"),
    ]
    for backend, call in itertools.product(("reference", "cpu"), calls):
        seen.clear()
        with ours.use_backend(backend):
            call()
        assert seen == [backend], (backend, seen)
    seen.clear()
    with ours.use_backend("reference"):
        ours.grpo_loss_trl(LP, LP, A, M, loss_type="bnpo", backend="cpu")
    assert seen == ["cpu"]
    seen.clear()
    ours.selective_log_softmax(L, IDX)
    assert seen == ["auto"]


def test_compiled_drop_in_follows_use_backend(monkeypatch):
    """Under torch.compile (fullgraph) the backend is read at trace time and guarded: a graph
    compiled in one ``use_backend`` block is never reused in another, nor after the block.
    (The spy marks each backend's output, so a stale graph would give the wrong value.)"""
    real = trainer_utils.logprobs_from_logits
    mark = {"cpu": 0.0, "auto": 100.0}

    def spy(*args, backend="auto", **kw):
        out = real(*args, backend=backend, **kw)
        return out._replace(logp=out.logp + mark[backend])  # (log-probs only: no entropy asked)

    monkeypatch.setattr(trainer_utils, "logprobs_from_logits", spy)
    torch._dynamo.reset()
    f = torch.compile(lambda x, i: ours.selective_log_softmax(x, i), fullgraph=True, backend="eager")
    plain = ours.selective_log_softmax(L, IDX) - mark["auto"]
    for backend in ("cpu", "auto", "cpu", None, "auto", None, "cpu"):
        with ours.use_backend(backend) if backend else contextlib.nullcontext():
            torch.testing.assert_close(f(L, IDX), plain + mark[backend or "auto"])
    torch._dynamo.reset()


def test_use_backend_refuses_unknown_backends():
    with pytest.raises(ValueError, match="backend"):
        with ours.use_backend("nope"):
            pass


def test_package_mirrors_trls_modules():
    """Each function lives in the module named after the TRL module that computes it."""
    mods = {
        "selective_log_softmax": "trainer_utils",
        "entropy_from_logits": "trainer_utils",
        "selective_log_softmax_and_entropy": "trainer_utils",
        "compute_grpo_advantages": "grpo_trainer",
        "grpo_loss_trl": "grpo_trainer",
        "compute_async_grpo_advantages": "async_rollout_worker",
    }
    for name, mod in mods.items():
        assert getattr(ours, name).__module__ == f"rlvr_kernels.integrations.trl.{mod}"
    assert isinstance(ours.trainer_utils, types.ModuleType)
