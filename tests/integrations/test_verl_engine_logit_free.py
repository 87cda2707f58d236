"""verl's FSDP engine under ``apply()``: the forward step without the ``[tokens, vocab]`` logits.

verl's own ``FSDPEngineWithLMHead`` (``infer_batch`` = compute_log_prob, ``train_batch`` = the
actor update) on a config-built Qwen2 in one process (``rlvr_kernels.testing.verl_engine``).
Stock runs verl's logits path; applied, the engine's forward_step computes the log-probs
and entropy from the hidden states and the LM head. Checked here: no allocation of
``tokens × vocab`` elements or more during either call (the CPU allocator's events, recorded
by the profiler, and the C++ kernels' own output allocator; stock's logits prove the probe
sees them), verl's numbers in both layouts (remove-padding and padded) and with per-row
temperatures, the settings of ``apply()`` reaching the op, and the configurations it does
not serve raising NotImplementedError naming the reason (apply(logit_free=False) runs verl's
logits path for them).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers
from _memory import largest_allocation
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp import transformer_impl as ti
from verl.workers.utils import losses as verl_losses

import rlvr_kernels
from rlvr_kernels.integrations import _head_grad
from rlvr_kernels.integrations import verl as rk
from rlvr_kernels.integrations._patch import call_counts, reset_call_counts, set_counting
from rlvr_kernels.integrations.verl import transformer_impl as ti_ours
from rlvr_kernels.testing import verl_engine
from rlvr_kernels.testing.dist import single_process_group

# vocab ≫ hidden, so tokens × vocab is more than any weight, activation or attention score
V, H, B, P, R = 8191, 16, 4, 8, 24
# rows of the C++ backward's logit-gradient block (kBwdRows in csrc/logprobs.cpp)
KERNEL_BLOCK_ROWS = 256


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
    return verl_engine.saved_qwen2(
        vocab=V,
        hidden=H,
        intermediate=32,
        layers=1,
        heads=2,
        kv_heads=1,
        max_positions=512,
        head_scale=8.0,
        prefix="rk-verl-logit-free-",
    )


def _engine(monkeypatch, model_dir, model_cls=transformers.Qwen2ForCausalLM):
    return verl_engine.cpu_engine(monkeypatch, model_dir, micro_batch_size=B, model_cls=model_cls)


def _td(
    *, entropy=True, train=False, remove_padding=True, temperature=None, seed=0, prompt=P, response=R, **non_tensor
):
    batch = verl_engine.rollout_batch(vocab=V, batch=B, prompt=prompt, response=response, seed=seed)
    td = verl_engine.worker_batch(batch, micro_batch_size=B, entropy=entropy, train=train)
    tu.assign_non_tensor(td, use_remove_padding=remove_padding, **non_tensor)
    if isinstance(temperature, torch.Tensor):  # one per row
        del td["temperature"]
        td["temperature"] = temperature
    elif temperature is not None:
        tu.assign_non_tensor(td, temperature=temperature)
    return td


def _infer(engine, td):
    mo = engine.infer_batch(td)["model_output"]
    return {k: v.values().detach().clone() for k, v in mo.items()}


def _train(engine, td, loss_mode="vanilla", **overrides):
    overrides.setdefault("entropy_coeff", 0.01)
    config = verl_engine.actor_config(loss_mode, batch_size=B, micro_batch_size=B, **overrides)
    out = engine.train_batch(td, loss_function=functools.partial(verl_losses.ppo_loss, config=config))
    grads = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    return out["loss"], grads


def _close(a, b, tol):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        for k in a:
            _close(a[k], b[k], tol)
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            _close(x, y, tol)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    else:
        assert abs(a - b) <= tol * max(1.0, abs(b)), (a, b)


def _tokens(td) -> int:
    return int(td["input_ids"].offsets()[-1])


def _kernel_output_bytes(fn) -> int:
    """Bytes the C++ kernels' own output allocator (huge-page blocks and their cache, which
    ATen's allocator and so the profiler do not see) handed out while ``fn()`` runs: with the
    cache emptied first, every block is either still in use or back in the cache after."""
    rlvr_kernels.empty_cpu_cache()
    before = rlvr_kernels.cpu_cache_stats()
    fn()
    after = rlvr_kernels.cpu_cache_stats()
    return sum(after[k] - before[k] for k in ("cached_bytes", "in_use_bytes"))


# ---------------------------------------------------------------------------------------
# no [tokens, vocab] allocation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,grad_in_forward", [("infer_batch", None), ("train_batch", None), ("train_batch", True)])
def test_no_tokens_by_vocab_allocation(monkeypatch, model_dir, call, grad_in_forward):
    """The largest allocation: stock at least the fp32 logits (tokens × vocab × 4 bytes); applied,
    less than tokens × vocab bytes (a quarter of the logits). Entropy on."""

    def run():
        engine = _engine(monkeypatch, model_dir)
        td = _td(train=call == "train_batch", prompt=96, response=320)
        logits_bytes = _tokens(td) * V * 4
        step = (lambda: engine.infer_batch(td)) if call == "infer_batch" else (lambda: _train(engine, td))
        kernel_bytes = []
        largest = largest_allocation(lambda: kernel_bytes.append(_kernel_output_bytes(step)))
        return largest, kernel_bytes[0], logits_bytes

    stock, _, logits_bytes = run()
    assert stock >= logits_bytes, (stock, logits_bytes)
    rk.apply(grad_in_forward=grad_in_forward)
    # the head's gradient formed in the forward holds one chunk of logits at a time: a budget
    # of an eighth of this batch's logits makes the chunks distinct
    monkeypatch.setattr(_head_grad, "CHUNK_ELEMENTS", logits_bytes // 4 // 8)
    ours, kernel_bytes, _ = run()
    assert call_counts()["verl.forward_step"] == 1
    assert call_counts().get("verl.forward_step.grad_in_forward", 0) == int(bool(grad_in_forward))
    # (the largest left are weight-sized and the attention's [tokens, tokens] mask)
    assert ours < logits_bytes // 4, (ours, logits_bytes)
    # all the C++ kernels' outputs of the step together: the backward's workspace of one
    # block of KERNEL_BLOCK_ROWS rows of logit gradients, the weight's gradient, no [tokens, vocab]
    tokens = logits_bytes // (V * 4)
    assert tokens > 2 * KERNEL_BLOCK_ROWS, tokens  # the sizes make the bound distinct
    assert kernel_bytes <= (KERNEL_BLOCK_ROWS * V + 2 * V * H + tokens * H) * 4 + 4 * 65536, (kernel_bytes, tokens)
    assert kernel_bytes < 0.6 * logits_bytes, (kernel_bytes, logits_bytes)


# ---------------------------------------------------------------------------------------
# verl's numbers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "remove_padding,temperature",
    [(True, None), (False, None), (True, 0.7), (False, 1.3), (True, "rows"), (False, "rows")],
)
def test_matches_stock(monkeypatch, model_dir, remove_padding, temperature):
    """infer_batch (log-probs, entropy) and train_batch (loss, every gradient) to 1e-5, both
    layouts, a scalar temperature and one per row (a tensor, as verl's trainer may send)."""
    if temperature == "rows":
        temperature = torch.tensor([0.5, 1.0, 1.7, 0.9])

    def run():
        engine = _engine(monkeypatch, model_dir)
        inferred = _infer(engine, _td(remove_padding=remove_padding, temperature=temperature))
        trained = _train(engine, _td(train=True, remove_padding=remove_padding, temperature=temperature))
        return inferred, trained

    stock = run()
    rk.apply()
    ours = run()
    # (grad_in_forward auto: this model's head is below _head_grad.MIN_MACS)
    assert call_counts() == {"verl.forward_step": 2, "verl.forward_step.loss_rows": 1, "verl.ppo_loss": 1}, (
        call_counts()
    )
    assert stock[0]["log_probs"].dtype == ours[0]["log_probs"].dtype == torch.float32
    _close(ours, stock, 1e-5)


@pytest.mark.parametrize(
    "loss_mode,overrides",
    [(m, {}) for m in ti_ours.SEPARABLE_LOSS_MODES]
    + [
        ("vanilla", dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_type="low_var_kl")),
        ("vanilla", dict(clip_ratio_c=2.0, clip_ratio_high=0.28, loss_agg_mode="seq-mean-token-sum-norm")),
        ("gspo", {}),
        ("geo_mean", {}),
        ("clip_cov", {}),
    ],
)
def test_grad_in_forward_matches_stock(monkeypatch, model_dir, loss_mode, overrides):
    """train_batch with the head's gradient formed in the forward: verl's loss and every gradient
    to 1e-5 for each separable loss mode (and KL, entropy, other aggregations), none of their
    rows run through the head again; a mode that is not separable takes linear_logprobs'
    backward (the same numbers)."""
    if loss_mode == "clip_cov":
        torch.manual_seed(0)  # verl's clip_cov draws its token selection from the global RNG
    td = _td(train=True, entropy=True)
    stock = _train(_engine(monkeypatch, model_dir), td, loss_mode, **overrides)
    rk.apply(grad_in_forward=True)
    before = dict(_head_grad.STATS)
    if loss_mode == "clip_cov":
        torch.manual_seed(0)
    ours = _train(_engine(monkeypatch, model_dir), td, loss_mode, **overrides)
    separable = loss_mode in ti_ours.SEPARABLE_LOSS_MODES
    assert call_counts().get("verl.forward_step.grad_in_forward", 0) == int(separable), call_counts()
    assert call_counts()["verl.forward_step.loss_rows"] == 1
    assert _head_grad.STATS["steps"] - before["steps"] == int(separable)
    assert _head_grad.STATS["rerun_rows"] == before["rerun_rows"]
    _close(ours, stock, 1e-5)


@pytest.mark.parametrize("temperature", [None, "rows"])
def test_grad_in_forward_padded_layout(monkeypatch, model_dir, temperature):
    """use_remove_padding=False (the padded batch, its rows gathered per sequence) with the head's
    gradient formed in the forward: verl's loss and gradients, no row run again."""
    if temperature == "rows":
        temperature = torch.tensor([0.5, 1.0, 1.7, 0.9])
    td = _td(train=True, remove_padding=False, temperature=temperature)
    stock = _train(_engine(monkeypatch, model_dir), td)
    rk.apply(grad_in_forward=True)
    rerun = _head_grad.STATS["rerun_rows"]
    ours = _train(_engine(monkeypatch, model_dir), td)
    assert call_counts()["verl.forward_step.grad_in_forward"] == 1
    assert _head_grad.STATS["rerun_rows"] == rerun
    _close(ours, stock, 1e-5)


@pytest.mark.parametrize("min_macs,formed", [(0, True), (1 << 62, False)])
def test_grad_in_forward_auto(monkeypatch, model_dir, min_macs, formed):
    """apply()'s grad_in_forward=None: formed in the forward for CPU rows with at least
    _head_grad.MIN_MACS multiply-adds per GEMM, else linear_logprobs' backward; verl's numbers."""
    td = _td(train=True)
    stock = _train(_engine(monkeypatch, model_dir), td)
    rk.apply()
    monkeypatch.setattr(_head_grad, "MIN_MACS", min_macs)
    ours = _train(_engine(monkeypatch, model_dir), td)
    assert call_counts().get("verl.forward_step.grad_in_forward", 0) == int(formed), call_counts()
    _close(ours, stock, 1e-5)


def test_grad_in_forward_not_with_a_gradient_scaler(monkeypatch, model_dir):
    """An engine with a gradient scaler (verl's fp16 path: its backward gets the loss times the
    scale, which the probe does not see) takes linear_logprobs' backward: verl's numbers, the
    head not formed in the forward, no row run again."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    td = _td(train=True)

    def scaled_engine():
        engine = _engine(monkeypatch, model_dir)
        engine.scaler = ShardedGradScaler(device="cpu", init_scale=16.0)
        return engine

    stock = _train(scaled_engine(), td)
    rk.apply(grad_in_forward=True)
    before = dict(_head_grad.STATS)
    ours = _train(scaled_engine(), td)
    assert "verl.forward_step.grad_in_forward" not in call_counts(), call_counts()
    assert call_counts()["verl.forward_step.loss_rows"] == 1
    assert _head_grad.STATS == before
    _close(ours, stock, 1e-5)


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_static_pad_to_length(monkeypatch, model_dir, grad_in_forward):
    """verl's pad_to_length (the packed micro-batch right-padded to a bucket boundary, a static
    pad_size > 0 that prepare_model_outputs cuts off): train_batch and infer_batch give verl's
    numbers, the loss rows and the head formed in the forward as without the pad."""
    td = _td(train=True)
    assert _tokens(td) % 64, "the batch must not already end on the bucket"

    def padded_engine():
        engine = _engine(monkeypatch, model_dir)
        engine.pad_to_length, engine.pad_to_length_bucket = True, 64
        assert engine._get_packed_pad_size(_tokens(td)) > 0
        return engine

    stock = _train(padded_engine(), td), _infer(padded_engine(), _td())
    rk.apply(grad_in_forward=grad_in_forward)
    rerun = _head_grad.STATS["rerun_rows"]
    ours = _train(padded_engine(), td), _infer(padded_engine(), _td())
    assert call_counts()["verl.forward_step.loss_rows"] == 1
    assert call_counts().get("verl.forward_step.grad_in_forward", 0) == int(grad_in_forward), call_counts()
    assert _head_grad.STATS["rerun_rows"] == rerun
    _close(ours, stock, 1e-5)


def test_grad_in_forward_and_loss_rows_off(monkeypatch, model_dir):
    """apply(loss_rows_only=False, grad_in_forward=False): every row through linear_logprobs and
    its backward, verl's numbers; both are refused without the logit-free engine."""
    td = _td(train=True)
    stock = _train(_engine(monkeypatch, model_dir), td)
    rk.apply(loss_rows_only=False, grad_in_forward=False)
    ours = _train(_engine(monkeypatch, model_dir), td)
    assert call_counts() == {"verl.forward_step": 1, "verl.ppo_loss": 1}, call_counts()
    _close(ours, stock, 1e-5)
    for name, value in (("loss_rows_only", False), ("grad_in_forward", False), ("grad_in_forward", True)):
        with pytest.raises(ValueError, match=name):
            rk.apply(logit_free=False, **{name: value})
    for name in ("loss_rows_only", "grad_in_forward"):
        with pytest.raises(TypeError, match=name):
            rk.apply(**{name: 1})
    rk.apply(logit_free=False)  # the defaults (True, None: auto) are accepted without it


def test_match_sampling_reaches_the_op(monkeypatch, model_dir):
    """apply(match_sampling=True): the log-probs of the rollout's top-k / top-p kept set, as the
    logits path with the drop-ins scores them (apply(logit_free=False)). (The entropies differ
    where a target lies outside its row's kept set: it joins the set here, as in the
    linear_cross_entropy drop-in, while entropy_from_logits sees no targets; the random
    targets of this batch often do.)"""
    rollout = dict(name="vllm", top_k=40, top_p=0.9)
    out = {}
    for logit_free in (True, False):
        rk.apply(match_sampling=True, rollout_config=rollout, logit_free=logit_free)
        out[logit_free] = _infer(_engine(monkeypatch, model_dir), _td(temperature=0.8))
    assert call_counts()["verl.forward_step"] == 1 and call_counts()["verl.logprobs_from_logits"] == 1
    _close(out[True]["log_probs"], out[False]["log_probs"], 1e-5)
    rk.unapply()
    full = _infer(_engine(monkeypatch, model_dir), _td(temperature=0.8))
    assert (out[True]["log_probs"] != full["log_probs"]).any()  # the kept set changed something


# ---------------------------------------------------------------------------------------
# what runs verl's logits path instead
# ---------------------------------------------------------------------------------------


class _ScaledQwen2(transformers.Qwen2ForCausalLM):
    """A head that is not lm_head(hidden): its logits are scaled in forward."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


def test_unknown_model_forward_raises(monkeypatch, model_dir):
    """A model class whose forward is not a known lm_head(hidden): NotImplementedError naming
    it; apply(logit_free=False) runs verl's logits path (its numbers, here the scaled logits)."""
    stock = _infer(_engine(monkeypatch, model_dir, _ScaledQwen2), _td())
    rk.apply()
    with pytest.raises(NotImplementedError, match=r"_ScaledQwen2.*logit_free=False"):
        _infer(_engine(monkeypatch, model_dir, _ScaledQwen2), _td())
    rk.unapply()
    rk.apply(logit_free=False)
    _close(_infer(_engine(monkeypatch, model_dir, _ScaledQwen2), _td()), stock, 1e-5)


def test_sum_pi_squared_raises(monkeypatch, model_dir):
    """calculate_sum_pi_squared needs the logits: NotImplementedError naming it; verl's path
    under apply(logit_free=False)."""
    td = functools.partial(_td, calculate_sum_pi_squared=True)
    stock = _infer(_engine(monkeypatch, model_dir), td())
    rk.apply()
    with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared"):
        _infer(_engine(monkeypatch, model_dir), td())
    rk.unapply()
    rk.apply(logit_free=False)
    ours = _infer(_engine(monkeypatch, model_dir), td())
    assert "sum_pi_squared" in ours
    _close(ours, stock, 1e-5)


def test_swaps_are_undone(monkeypatch, model_dir):
    """After a step (and after a step that raised) the engine and the model hold no instance
    attributes of the swap."""
    rk.apply()
    engine = _engine(monkeypatch, model_dir)
    engine.infer_batch(_td())
    assert "forward" not in vars(engine.module)
    assert "prepare_model_inputs" not in vars(engine) and "prepare_model_outputs" not in vars(engine)
    bad = _td()
    bad["input_ids"] = torch.nested.nested_tensor_from_jagged(
        bad["input_ids"].values() + V, bad["input_ids"].offsets()
    )  # out-of-vocabulary ids: the embedding raises
    with warnings.catch_warnings(), pytest.raises((IndexError, RuntimeError, ValueError)):
        engine.infer_batch(bad)
    assert "forward" not in vars(engine.module)
    assert "prepare_model_inputs" not in vars(engine) and "prepare_model_outputs" not in vars(engine)


def test_unapply_restores_forward_step():
    original = ti.FSDPEngineWithLMHead.forward_step
    rk.apply()
    assert ti.FSDPEngineWithLMHead.forward_step is not original
    assert ti.FSDPEngineWithLMHead.forward_step.__wrapped_verl__ is original
    rk.unapply()
    assert ti.FSDPEngineWithLMHead.forward_step is original
    rk.apply(logit_free=False)
    assert ti.FSDPEngineWithLMHead.forward_step is original
    rk.unapply()
    with pytest.raises(TypeError, match="logit_free"):
        rk.apply(logit_free="yes")


def test_engine_subclass_with_its_own_outputs_runs_its_step(monkeypatch, model_dir):
    """An engine class with its own prepare_model_outputs (as the value-head engine, which
    inherits forward_step): its own step, no warning."""
    seen = []

    class Engine(ti.FSDPEngineWithLMHead):
        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            seen.append(output.logits.shape)
            return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)

    stock = _infer(_engine(monkeypatch, model_dir), _td())
    rk.apply()
    engine = _engine(monkeypatch, model_dir)
    engine.__class__ = Engine
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ours = _infer(engine, _td())
    assert call_counts()["verl.forward_step[verl]"] == 1 and seen and seen[0][-1] == V
    _close(ours, stock, 1e-5)
