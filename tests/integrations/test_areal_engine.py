"""AReaL's own FSDP engine under ``apply()``: the PPO actor's update on the fused loss, and the
micro-batch step without the ``[tokens, vocab]`` logits.

AReaL 1.0.4's ``FSDPPPOActor`` / ``FSDPEngine`` on a config-built Qwen2 in one process
(``rlvr_kernels.testing.areal_engine``: AReaL's CPU platform, a world-size-1 gloo group, FSDP2
over a one-rank mesh, AReaL's optimizer). Checked here: the whole PPO update
(``compute_logp``, ``compute_advantages`` with group reward and batch advantage normalisation,
``ppo_update`` with decoupled PPO and rejection sampling over minibatches and micro-batches)
gives stock's parameters; ``forward_batch`` / ``train_batch`` / ``eval_batch`` give stock's
numbers (temperature, several micro-batches); no allocation of ``tokens × vocab`` elements or
more during ``train_batch`` (the CPU allocator's events, recorded by the profiler; stock's
logits prove the probe sees them); a call the logit-free path does not serve raises naming the
reason, or with ``strict=False`` warns and runs AReaL's logits path; ``unapply()`` restores the
identical objects."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers
from _memory import largest_allocation
from areal.api.cli_args import MicroBatchSpec, NormConfig, RejectionSamplingConfig
from areal.engine import fsdp_engine as peer_engine
from areal.utils import functional as peer_functional
from areal.utils import stats_tracker
from areal.utils.functional import vocab_parallel as peer_vocab

from rlvr_kernels.integrations import _head_grad
from rlvr_kernels.integrations import areal as rk
from rlvr_kernels.integrations._patch import call_counts, reset_call_counts, set_counting
from rlvr_kernels.testing import areal_engine as ae
from rlvr_kernels.testing.peers import import_areal_actor

peer_actor = import_areal_actor()

# vocab ≫ hidden, so tokens × vocab is more than any weight, activation or attention score
V, H = 8191, 16


@pytest.fixture(scope="module", autouse=True)
def one_process():
    with ae.single_process():
        yield


@pytest.fixture(scope="module", autouse=True)
def eager_stock():
    """AReaL's logits path with its two gather functions eager: AReaL wraps them in
    ``torch.compile`` (``areal/utils/functional/vocab_parallel.py``), whose inductor compile
    of each new shape takes seconds on the CPU; the functions and their numbers are the same."""
    saved = {name: getattr(peer_vocab, name) for name in ("_gather_logprobs", "_gather_logprobs_entropy")}
    for name, fn in saved.items():
        setattr(peer_vocab, name, getattr(fn, "_torchdynamo_orig_callable", fn))
    yield
    for name, fn in saved.items():
        setattr(peer_vocab, name, fn)


@pytest.fixture(autouse=True)
def clean_patch():
    set_counting(True)
    reset_call_counts()
    stats_tracker.export_all()  # AReaL's trainer exports (and resets) its statistics after each step
    yield
    rk.unapply()
    set_counting(False)
    reset_call_counts()


@pytest.fixture(scope="module")
def model_dir():
    cfg = transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return ae.save_model(cfg, head_scale=8.0)  # peaked distributions


def trajectories(batch, group=2):
    """AReaL's per-trajectory list: one dict per group of ``group`` rows."""
    B = batch["input_ids"].shape[0]
    return [{k: v[i : i + group].clone() for k, v in batch.items()} for i in range(0, B, group)]


def ppo_update(model_dir):
    """AReaL's actor update on one rollout: (the proximal log-probs, the log-probs after)."""
    config = ae.engine_config(
        model_dir,
        actor=True,
        temperature=0.8,
        use_decoupled_loss=True,
        rejection_sampling=RejectionSamplingConfig(upper=1.06, lower=0.94),
        eps_clip=0.2,
        eps_clip_higher=0.28,
        c_clip=3.0,
        ppo_n_minibatches=2,
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
        adv_norm=NormConfig(),
        kl_ctl=0.0,
        mb_spec=MicroBatchSpec(n_mbs=2),
    )
    engine = ae.build_engine(config)
    batch = ae.rollout_batch(V, B=4, P=6, C=12, seed=1)
    data = trajectories(batch)
    g = torch.Generator().manual_seed(2)
    for d, lp in zip(data, engine.compute_logp(data)):
        d["prox_logp"] = lp
        # the behaviour log-probs near the proximal ones (at the token, as the rollout gives
        # them; compute_logp's are at the position predicting it), so that some pass the bounds
        near = torch.roll(lp, 1, dims=-1) + 0.05 * torch.randn(lp.shape, generator=g)
        d["logprobs"] = torch.where(d["loss_mask"].bool(), near, 0.0)
    prox = torch.cat([d["prox_logp"] for d in data])
    engine.ppo_update(engine.compute_advantages(data))
    return prox, torch.cat(engine.compute_logp(trajectories(batch)))


def test_ppo_actor_update_matches_stock(model_dir):
    """``rk.apply()``, then AReaL's own PPOActor: its grpo_loss_fn ran the fused loss on the
    logit-free step, and the parameters after the update are stock's."""
    prox_stock, after_stock = ppo_update(model_dir)
    rk.apply()
    prox, after = ppo_update(model_dir)
    counts = call_counts()
    assert counts["areal.FSDPEngine.forward_backward_batch"] == 2  # compute_logp: every row
    assert counts["areal.FSDPEngine.forward_backward_batch[loss rows]"] == 2  # the 2 minibatches
    assert counts["areal.ppo_actor_loss_fn"] == 4  # 2 minibatches × 2 micro-batches
    torch.testing.assert_close(prox, prox_stock, atol=5e-6, rtol=0)
    assert (after_stock - prox_stock).abs().max() > 1e-4  # the update moved the policy
    torch.testing.assert_close(after, after_stock, atol=5e-6, rtol=0)


def engine(model_dir, temperature=0.7, n_mbs=2):
    return ae.build_engine(ae.engine_config(model_dir, temperature=temperature, mb_spec=MicroBatchSpec(n_mbs=n_mbs)))


def train_data(seed=2, B=4, P=8, C=48):
    """A rollout with what grpo_loss_fn reads (already shifted as compute_advantages leaves it)."""
    batch = ae.rollout_batch(V, B=B, P=P, C=C, seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = batch["loss_mask"].bool()
    batch["prox_logp"] = torch.where(mask, batch["logprobs"] + 0.1 * torch.randn(mask.shape, generator=g), 0.0)
    batch["advantages"] = torch.where(mask, torch.randn(mask.shape, generator=g), 0.0)
    return batch


LOSS = functools.partial(
    peer_actor.grpo_loss_fn,
    eps_clip=0.2,
    eps_clip_higher=0.28,
    c_clip=None,
    use_decoupled_loss=True,
    rejection_sampling=RejectionSamplingConfig(level="sequence", action="clamp", upper=1.2),
)


def weight(x):
    return x["loss_mask"].count_nonzero()


def steps(model_dir, temperature):
    e = engine(model_dir, temperature)
    data = train_data()
    before = e.forward_batch(copy.deepcopy(data))
    ev = e.eval_batch(copy.deepcopy(data), loss_fn=LOSS, loss_weight_fn=weight)
    stats = e.train_batch(copy.deepcopy(data), loss_fn=LOSS, loss_weight_fn=weight)
    logged = stats_tracker.export_all()
    after = e.forward_batch(copy.deepcopy(data))
    return before, ev, stats["grad_norm"], after, logged


# what grpo_loss_fn logs from every logit (vocab_min_logits / vocab_max_logits): not served
_VOCAB_STATS = ("vocab_min_logits", "vocab_max_logits")


@pytest.mark.parametrize(
    "temperature,loss_rows_only,grad_in_forward",
    [(1.0, True, True), (0.7, True, True), (0.7, False, True), (0.7, True, False)],
)
def test_engine_steps_match_stock(model_dir, temperature, loss_rows_only, grad_in_forward):
    """forward_batch (every row), eval_batch and train_batch with grpo_loss_fn (only the
    loss-mask rows through the head, or every row; the head's gradient formed in the forward,
    no row run again, or not) give stock's numbers, and grpo_loss_fn logs the same statistics
    (the probes of the loss leave none behind)."""
    stock = steps(model_dir, temperature)
    rk.apply(loss_rows_only=loss_rows_only, grad_in_forward=grad_in_forward)
    rerun = _head_grad.STATS["rerun_rows"]
    ours = steps(model_dir, temperature)
    counts = call_counts()
    if loss_rows_only:
        assert counts["areal.FSDPEngine.forward_backward_batch"] == 2
        assert counts["areal.FSDPEngine.forward_backward_batch[loss rows]"] == 2
    else:
        assert counts["areal.FSDPEngine.forward_backward_batch"] == 4
    # (counted per micro-batch: train_batch's two)
    assert counts.get("areal.FSDPEngine.forward_backward_batch.grad_in_forward", 0) == 2 * int(grad_in_forward)
    assert _head_grad.STATS["rerun_rows"] == rerun
    torch.testing.assert_close(ours[0], stock[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], stock[1], atol=1e-6, rtol=1e-5)
    assert ours[2] == pytest.approx(stock[2], rel=1e-5)
    torch.testing.assert_close(ours[3], stock[3], atol=1e-5, rtol=0)
    logged, stock_logged = ours[4], {k: v for k, v in stock[4].items() if not any(v in k for v in _VOCAB_STATS)}
    assert logged.keys() == stock_logged.keys(), sorted(set(logged) ^ set(stock_logged))
    for key, value in stock_logged.items():
        assert logged[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_no_tokens_by_vocab_allocation(monkeypatch, model_dir):
    """The largest allocation of a train_batch: stock at least the fp32 logits of the valid
    tokens (tokens × vocab × 4 bytes); applied, less than a quarter of that."""

    def run():
        e = engine(model_dir, n_mbs=1)
        data = train_data()
        largest = largest_allocation(lambda: e.train_batch(data, loss_fn=LOSS, loss_weight_fn=weight))
        stats_tracker.export_all()
        return largest

    tokens = int(train_data()["attention_mask"].sum())
    logits_bytes = tokens * V * 4
    stock = run()
    assert stock >= logits_bytes, (stock, logits_bytes)
    rk.apply(grad_in_forward=True)
    # the head's gradient formed in the forward holds one chunk of logits at a time: a budget
    # of an eighth of this batch's logits makes the chunks distinct
    monkeypatch.setattr(_head_grad, "CHUNK_ELEMENTS", logits_bytes // 4 // 8)
    ours = run()
    assert call_counts()["areal.FSDPEngine.forward_backward_batch[loss rows]"] == 1
    assert call_counts()["areal.FSDPEngine.forward_backward_batch.grad_in_forward"] == 1
    assert ours < logits_bytes // 4, (ours, logits_bytes)


def test_unserved_call_raises_or_warns(model_dir):
    """A model forward the fused head cannot vouch for (here an instance attribute): strict
    raises naming it; strict=False warns once and runs AReaL's logits path, stock's numbers."""
    e = engine(model_dir)
    data = train_data()
    stock = e.forward_batch(copy.deepcopy(data))
    original = e.model.forward
    e.model.forward = lambda *a, **k: original(*a, **k)
    rk.apply()
    with pytest.raises(NotImplementedError, match="model's forward"):
        e.forward_batch(copy.deepcopy(data))
    rk.apply(strict=False)
    with pytest.warns(RuntimeWarning, match="running AReaL's logits path"):
        got = e.forward_batch(copy.deepcopy(data))
    torch.testing.assert_close(got, stock)
    assert call_counts()["areal.FSDPEngine.forward_backward_batch[logits]"] == 1
    del e.model.forward
    e.is_vision_model = True
    rk.apply()
    with pytest.raises(NotImplementedError, match="vision-language"):
        e.forward_batch(copy.deepcopy(data))


def test_logits_path_drop_ins(model_dir):
    """apply(logit_free=False): AReaL's logits, its gathers the fused drop-ins (the engine's
    by-name imports swept), stock's numbers."""
    stock = steps(model_dir, 0.7)
    rk.apply(logit_free=False)
    assert peer_engine.gather_logprobs_entropy is rk.gather_logprobs_entropy
    ours = steps(model_dir, 0.7)
    counts = call_counts()
    # 2 forward_batch and 2 loss steps, 2 micro-batches each
    assert counts["areal.gather_logprobs"] == 4 and counts["areal.gather_logprobs_entropy"] == 4
    assert "areal.FSDPEngine.forward_backward_batch" not in counts
    torch.testing.assert_close(ours[0], stock[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], stock[1], atol=1e-6, rtol=1e-5)
    assert ours[2] == pytest.approx(stock[2], rel=1e-5)
    torch.testing.assert_close(ours[3], stock[3], atol=1e-5, rtol=0)


@pytest.mark.parametrize("setting", [dict(m2_threshold=0.04), dict(importance_sampling_level="sequence")])
def test_grad_in_forward_only_for_a_separable_loss(model_dir, setting):
    """M2PO's token selection and a sequence-level importance ratio are not separable over
    tokens: linear_logprobs' backward, stock's numbers."""
    loss = functools.partial(LOSS, **setting)

    def run():
        e = engine(model_dir, n_mbs=1)
        out = e.train_batch(train_data(), loss_fn=loss, loss_weight_fn=weight)
        stats_tracker.export_all()
        return out["grad_norm"]

    stock = run()
    rk.apply(grad_in_forward=True)
    ours = run()
    counts = call_counts()
    assert counts["areal.FSDPEngine.forward_backward_batch[loss rows]"] == 1
    assert "areal.FSDPEngine.forward_backward_batch.grad_in_forward" not in counts
    assert ours == pytest.approx(stock, rel=1e-5)


def test_other_loss_fn_scores_every_row(model_dir):
    """A loss_fn other than grpo_loss_fn gets every row's log-prob and entropy (stock's)."""
    got = {}

    def loss_fn(logprobs, entropy, mb, **kwargs):
        got.setdefault("logprobs", []).append(logprobs.detach())
        got.setdefault("entropy", []).append(entropy.detach())
        return logprobs.mean()

    def run():
        got.clear()
        engine(model_dir).train_batch(train_data(), loss_fn=loss_fn, loss_weight_fn=weight)
        return torch.cat(got["logprobs"]), torch.cat(got["entropy"])

    stock = run()
    rk.apply()
    ours = run()
    assert call_counts()["areal.FSDPEngine.forward_backward_batch"] == 1
    torch.testing.assert_close(ours[0], stock[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], stock[1], atol=1e-5, rtol=1e-5)


def test_swaps_are_undone(model_dir):
    e = engine(model_dir)
    rk.apply()
    e.forward_batch(train_data())
    e.train_batch(train_data(), loss_fn=LOSS, loss_weight_fn=weight)
    assert "forward" not in vars(e.model)
    assert "_prepare_mb_inputs" not in vars(e)
    assert not any(k.startswith("_rlvr_kernels") for k in vars(e))


def test_unapply_restores_identical_objects():
    cls = peer_engine.FSDPEngine
    names = ("forward_backward_batch", "_compute_logprobs_and_loss", "_compute_forward_result")
    before = {n: cls.__dict__[n] for n in names}
    losses = (peer_functional.ppo_actor_loss_fn, peer_functional.sapo_loss_fn, peer_actor.ppo_actor_loss_fn)
    rk.apply()
    assert peer_actor.ppo_actor_loss_fn is rk.ppo_actor_loss_fn  # the by-name import, swept
    assert peer_functional.sapo_loss_fn is rk.sapo_loss_fn
    assert all(cls.__dict__[n] is not before[n] for n in names)
    assert rk.applied_options() == dict(
        policy_loss=True,
        logprobs=True,
        logit_free=True,
        logits_precision="fp32",
        loss_rows_only=True,
        grad_in_forward=None,
        strict=True,
    )
    assert rk.unapply()
    assert all(cls.__dict__[n] is before[n] for n in names)
    assert (peer_functional.ppo_actor_loss_fn, peer_functional.sapo_loss_fn, peer_actor.ppo_actor_loss_fn) == losses
    assert not rk.unapply()


def test_apply_checks_its_arguments():
    with pytest.raises(TypeError, match="logit_free"):
        rk.apply(logit_free=1)
    with pytest.raises(ValueError, match="logits_precision"):
        rk.apply(logits_precision="fp16")
    with pytest.raises(ValueError, match="logits_precision"):
        rk.apply(logit_free=False, logits_precision="bf16")
    with pytest.raises(ValueError, match="loss_rows_only"):
        rk.apply(logit_free=False, loss_rows_only=False)
    with pytest.raises(ValueError, match="grad_in_forward"):
        rk.apply(logit_free=False, grad_in_forward=False)
    with pytest.raises(TypeError, match="grad_in_forward"):
        rk.apply(grad_in_forward="auto")
    assert not rk.is_applied()


def test_version_gate(monkeypatch):
    import areal

    from rlvr_kernels.integrations._patch import PatchError

    monkeypatch.setattr(areal, "__version__", "1.1.0")
    with pytest.raises(PatchError, match="1.1.0"):
        rk.apply()
    assert not rk.is_applied()
    with pytest.warns(RuntimeWarning, match="1.1.0"):
        rk.apply(strict=False)
    assert rk.is_applied()
