"""The AsyncGRPOTrainer part of ``integrations.trl.apply()`` (``_async_patch.async_targets``), on
TRL 1.16's real ``AsyncGRPOTrainer``: built on CPU from a tiny Qwen2 saved from a config
(no download) with an in-memory word-level tokenizer, a stub rollout worker and a no-op
weight transfer (TRL's injection points), so no vLLM server is involved. Nothing inside
TRL is stubbed: its CUDA-only MFU probe is one of the names async_targets() replaces.

Its compute_loss runs on the micro-batches its own planner (``TokenBudgetBatcher``) and
collator (``DataCollatorForRollout``) pack from synthetic rollout samples. TRL's own tree
attention is FA3 from the Hub, CUDA only: the stock trainer cannot run a forward here. So
the applied trainer's loss, gradients and metrics are checked against each sample run
alone, unpacked, through plain eager attention with TRL's loss formula; and TRL's own
compute_loss (which can run once our attention is in) against the fused one. Last, one
optimizer step of ``trainer.train()`` itself (TRL's rollout queue, planner, collator,
dispatcher and training_step) runs on CPU, with the fused loss and with TRL's, to the same
parameters, loss and metrics.
"""

from __future__ import annotations

import contextlib
import queue
import random
import warnings
from collections import defaultdict

import pytest
import torch

from rlvr_kernels.integrations import _patch
from rlvr_kernels.integrations._patch import Patcher
from rlvr_kernels.integrations.trl import _async_patch as AP

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import trl.experimental.async_grpo.async_grpo_trainer as async_grpo
    import trl.experimental.async_grpo.packing as trl_packing
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

pytestmark = [
    pytest.mark.cpu_kernel,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

VOCAB = 53
EPS_LOW, EPS_HIGH, TEMPERATURE, GA_STEPS = 0.2, 0.28, 0.7, 2
METRICS = (
    "ratio",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)
NAME = trl_packing.TREE_ATTENTION
STOCK_TREE_ROW = trl_packing.TreeRow  # collected before any test patches
assert STOCK_TREE_ROW.__module__ == trl_packing.__name__
_ABSENT = object()


def _state():
    """Every object async_targets() may replace, as stored."""
    return {
        "trainer.TreeRow": async_grpo.TreeRow,
        "trainer.register_tree_attention": async_grpo.register_tree_attention,
        "trainer.get_peak_flops_per_device": async_grpo.get_peak_flops_per_device,
        "packing.TreeRow": trl_packing.TreeRow,
        "packing.tree_attention": trl_packing.tree_attention,
        "packing.register_tree_attention": trl_packing.register_tree_attention,
        "compute_loss": vars(async_grpo.AsyncGRPOTrainer)["compute_loss"],
        "attention": AttentionInterface._global_mapping.get(NAME, _ABSENT),
        "mask": AttentionMaskInterface._global_mapping.get(NAME, _ABSENT),
    }


@contextlib.contextmanager
def _counting():
    _patch.set_counting(True)
    _patch.reset_call_counts()
    try:
        yield
    finally:
        _patch.set_counting(False)


# ----------------------------------------------------------------------------- patch / restore


@pytest.mark.parametrize("registered", [False, True])
def test_install_replaces_every_name_and_restore_puts_back_the_same_objects(registered):
    saved = _state()
    try:
        AttentionInterface._global_mapping.pop(NAME, None)
        AttentionMaskInterface._global_mapping.pop(NAME, None)
        if registered:  # as after a stock trainer was built: TRL's FA3 entry is there
            trl_packing.register_tree_attention()
        before = _state()
        assert before["packing.TreeRow"].__module__ == trl_packing.__name__
        assert (before["attention"] is trl_packing.tree_attention) == registered

        patcher = Patcher("trl")
        patcher.apply(AP.async_targets(strict=True, loss=True))
        after = _state()
        assert after["trainer.TreeRow"] is after["packing.TreeRow"] is AP.TreeRow
        assert after["packing.tree_attention"] is after["attention"] is AP.tree_attention
        assert after["trainer.register_tree_attention"] is AP.register_tree_attention
        assert after["packing.register_tree_attention"] is AP.register_tree_attention
        assert after["mask"] is AP._no_mask
        assert after["trainer.get_peak_flops_per_device"].__wrapped__ is before["trainer.get_peak_flops_per_device"]
        assert after["compute_loss"].__wrapped__ is before["compute_loss"]
        # what from_pretrained(attn_implementation=TREE_ATTENTION) looks up, and what the
        # trainer's __init__ re-registers, are ours
        assert AttentionInterface()[NAME] is AP.tree_attention
        async_grpo.register_tree_attention()
        assert AttentionInterface()[NAME] is AP.tree_attention

        patcher.restore()
        restored = _state()
        for key, value in before.items():
            assert restored[key] is value, key
        assert (NAME in AttentionInterface._global_mapping) == registered
        assert (NAME in AttentionMaskInterface._global_mapping) == registered
    finally:
        for mapping, key in (
            (AttentionInterface._global_mapping, "attention"),
            (AttentionMaskInterface._global_mapping, "mask"),
        ):
            mapping.pop(NAME, None)
            if saved[key] is not _ABSENT:
                mapping[NAME] = saved[key]


def test_a_moved_name_raises_before_anything_changes(monkeypatch):
    before = _state()
    monkeypatch.delattr(trl_packing, "tree_attention")
    with pytest.raises(_patch.PatchError, match="tree_attention"):
        Patcher("trl").apply(AP.async_targets(strict=True, loss=True))
    monkeypatch.undo()
    after = _state()
    assert all(after[k] is v for k, v in before.items())


def test_attention_path_per_device(monkeypatch):
    q = torch.zeros(1, 2, 3, 4)
    assert AP.tree_attention_path(q) == "rk_tree_sdpa"
    assert AP.tree_attention_path(q.to(torch.bfloat16)) == "rk_tree_sdpa"

    class CudaQuery:  # the path reads the device and dtype only (no GPU here)
        device = torch.device("cuda")

        def __init__(self, dtype):
            self.dtype = dtype

    fp32_module, bf16_module = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16)
    for flash in (True, False):
        monkeypatch.setattr(AP, "_flash_attn_available", lambda: flash)
        half = "rk_tree_varlen" if flash else "rk_tree_flex"
        assert AP.tree_attention_path(CudaQuery(torch.bfloat16), fp32_module) == half
        assert AP.tree_attention_path(CudaQuery(torch.float16), None) == half
        assert AP.tree_attention_path(CudaQuery(torch.float32), bf16_module) == half  # flash runs in bf16
        assert AP.tree_attention_path(CudaQuery(torch.float32), fp32_module) == "rk_tree_flex"  # no fp32 flash


# ----------------------------------------------------------------------------- the trainer


def _samples(seed: int = 0, n_groups: int = 5, group_size: int = 4):
    """Rollout samples as TRL's RolloutQueueDataset yields them: groups sharing a prompt
    (and a system prompt across groups), multi-turn masks, one completion fully masked,
    interleaved across groups as from the async queue."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(3)]
    out = []
    for g in range(n_groups):
        prompt = system + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 6))]
        for i in range(group_size):
            completion = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))]
            ids = prompt + completion
            mask = [0] * len(prompt) + [1] * len(completion)
            if rng.random() < 0.4:  # a tool turn inside the completion, untrained
                cut = rng.randrange(len(prompt), len(ids))
                mask[cut : cut + 2] = [0] * len(mask[cut : cut + 2])
            if g == 1 and i == 0:  # a completion with nothing trained
                mask = [0] * len(ids)
            out.append(
                dict(
                    input_ids=torch.tensor(ids),
                    completion_mask=torch.tensor(mask),
                    # near the current policy's log-probs, so some ratios leave the clip range
                    old_log_probs=-torch.rand(len(ids), generator=gen) * 4.0,
                    advantage=rng.uniform(-1, 1),
                    group_id=g,
                    metrics={"reward": rng.random()},
                )
            )
    rng.shuffle(out)
    return out


class _Worker:
    """TRL's RolloutWorkerProtocol with nothing behind it."""

    def __init__(self):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, version):
        pass

    def check_health(self, stale_after_s):
        pass


class _NoSync:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
        pad_token="t0",
        unk_token="t1",
        eos_token="t2",
    )


def _save_model(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # logits of order one, so the ratios to old_log_probs spread
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)


def build_trainer(tmp, worker):
    """TRL's AsyncGRPOTrainer on the model saved under ``tmp / "model"``, on CPU: a stub rollout
    worker, a no-op weight transfer, SGD (the update is the gradient: two losses' updates
    compare tightly), two gradient-accumulation steps."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig

    args = AsyncGRPOConfig(
        output_dir=str(tmp / "out"),
        bf16=False,
        dtype="float32",
        use_cpu=True,
        report_to=[],
        max_steps=1,
        gradient_accumulation_steps=GA_STEPS,
        optim="sgd",
        learning_rate=0.1,
        logging_steps=1,
        save_strategy="no",
        token_budget=40,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        temperature=TEMPERATURE,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return async_grpo.AsyncGRPOTrainer(
            model=str(tmp / "model"),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["t3"] * 4}),
            processing_class=_tokenizer(),
            rollout_worker=worker,
            weight_transfer=_NoSync(),
        )


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The applied AsyncGRPOTrainer (async_targets() applied before construction, as apply() then
    AsyncGRPOTrainer(...)), restored at the end of the module."""
    tmp = tmp_path_factory.mktemp("async_grpo")
    _save_model(tmp / "model")
    yield from applied_env(tmp)


def applied_env(tmp):
    """async_targets() applied, the trainer built on ``tmp / "model"``; yields the test env,
    then restores every patched name."""
    patcher, worker = Patcher("trl"), _Worker()
    try:
        with _counting():
            patcher.apply(AP.async_targets(strict=True, loss=True))
            trainer = build_trainer(tmp, worker)
            init_counts = _patch.call_counts()
        trainer.current_gradient_accumulation_steps = GA_STEPS
        yield dict(trainer=trainer, worker=worker, path=tmp / "model", init_counts=init_counts)
    finally:
        patcher.restore()


def _planner_batches(metrics, num_processes=2, budget=40):
    """Micro-batches from TRL's planner and collator (reading the module's TreeRow)."""
    batcher = async_grpo.TokenBudgetBatcher(_samples(), num_processes, budget, metrics)
    collator = async_grpo.DataCollatorForRollout(pad_token_id=0, num_processes=num_processes, metrics=metrics)
    out = []
    for rows in batcher:
        out.append(([list(row.samples) for row in rows], collator.torch_call([rows])))
    return out


def _rank_inputs(batch, rank):
    """What DataLoaderDispatcher hands rank ``rank``: row ``rank`` of every tensor."""
    return {k: v[rank : rank + 1] for k, v in batch.items()}


def _run(trainer, compute_loss, inputs):
    """loss, parameter gradients and the metrics one compute_loss call appended."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = compute_loss(trainer, model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _reference(ref_model, samples, global_n_tokens):
    """Each sample alone, unpacked, eager attention, full log-softmax; TRL's loss formula and
    metrics on the concatenated trained tokens (TRL's term order: sample by sample)."""
    ref_model.zero_grad(set_to_none=True)
    lps, ents, olds, advs, segs = [], [], [], [], []
    for i, s in enumerate(samples):
        ids, mask = s["input_ids"], s["completion_mask"].bool()
        logits = ref_model(input_ids=ids[None]).logits[0, :-1].float() / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        keep = mask[1:]
        lps.append(logp.gather(1, ids[1:, None])[:, 0][keep])
        ents.append(-(logp.exp() * logp).sum(-1)[keep].detach())
        olds.append(s["old_log_probs"][1:][keep])
        advs.append(torch.full((int(keep.sum()),), float(s["advantage"])))
        segs.append(torch.full((int(keep.sum()),), i))
    lp, ent, old, adv, seg = (torch.cat(x) for x in (lps, ents, olds, advs, segs))
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    loss = per_token.sum() / max(float(global_n_tokens), 1.0) / GA_STEPS
    loss.backward()
    with torch.no_grad():
        c = coef_1.detach()
        low = (c < 1 - EPS_LOW) & (adv < 0)
        high = (c > 1 + EPS_HIGH) & (adv > 0)
        n = len(samples)
        tok = torch.zeros(n).index_add_(0, seg, torch.ones_like(c))
        seq_low = torch.zeros(n).index_add_(0, seg, low.float()) / tok
        seq_high = torch.zeros(n).index_add_(0, seg, high.float()) / tok
        metrics = {
            "ratio": c.mean().item(),
            "kl": ((c - 1) - (lp.detach() - old)).mean().item(),
            "entropy": ent.mean().item(),
            "clip_ratio/low_mean": low.float().mean().item(),
            "clip_ratio/high_mean": high.float().mean().item(),
            "clip_ratio/region_mean": (low | high).float().mean().item(),
            "clip_ratio/low_min": seq_low[~seq_low.isnan()].min().item(),
            "clip_ratio/high_max": seq_high[~seq_high.isnan()].max().item(),
        }
    grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}
    return loss.detach(), grads, metrics


def test_trainer_is_built_on_our_attention(env):
    trainer = env["trainer"]
    assert trainer.model.config._attn_implementation == NAME
    assert AttentionInterface()[NAME] is AP.tree_attention
    assert env["init_counts"].get("trl.async_grpo.register_tree_attention", 0) >= 1
    assert env["init_counts"].get("trl.async_grpo.get_peak_flops_per_device", 0) == 1
    assert trainer._peak_flops_per_device is None  # MFU metrics off on CPU, as TRL for an unknown device


def test_planner_batches_are_trls(env):
    """Our TreeRow in TRL's planner and collator gives TRL's own micro-batches."""
    ours_metrics, theirs_metrics = defaultdict(list), defaultdict(list)
    with _counting():
        ours = _planner_batches(ours_metrics)
        counts = _patch.call_counts()
    assert counts["trl.async_grpo.TreeRow"] > 0 and counts["trl.async_grpo.TreeRow.pack"] > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(async_grpo, "TreeRow", STOCK_TREE_ROW)
        theirs = _planner_batches(theirs_metrics)
    assert len(ours) == len(theirs) > 1
    for (_, a), (_, b) in zip(ours, theirs):
        assert list(a) == list(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert dict(ours_metrics) == dict(theirs_metrics)


def test_compute_loss_matches_unpacked_eager_and_trls_own_loss(env):
    """On every rank-row of every micro-batch of the planner: the applied compute_loss (our
    tree attention on CPU, the fused loss) gives the loss, parameter gradients and TRL's
    metric set of each sample run alone through eager attention; and TRL's own compute_loss,
    run on our attention, gives the fused loss's numbers."""
    from transformers import Qwen2ForCausalLM

    trainer = env["trainer"]
    ref_model = Qwen2ForCausalLM.from_pretrained(env["path"], attn_implementation="eager").float()
    trl_compute_loss = async_grpo.AsyncGRPOTrainer.compute_loss.__wrapped__
    fused = async_grpo.AsyncGRPOTrainer.compute_loss
    batches = _planner_batches(defaultdict(list))
    clipped = 0.0
    with _counting():
        for rows, batch in batches:
            for rank, samples in enumerate(rows):
                inputs = _rank_inputs(batch, rank)
                loss, grads, metrics = _run(trainer, fused, inputs)
                ref_loss, ref_grads, ref_metrics = _reference(ref_model, samples, batch["global_n_tokens"][0])
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
                for name, g in ref_grads.items():
                    torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
                assert set(METRICS) <= set(metrics)
                for key in METRICS:
                    assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-6), key
                clipped += metrics["clip_ratio/region_mean"]

                trl_loss, trl_grads, trl_metrics = _run(trainer, trl_compute_loss, inputs)
                torch.testing.assert_close(loss, trl_loss, rtol=1e-6, atol=1e-8)
                for name, g in trl_grads.items():
                    torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-8, msg=name)
                assert set(trl_metrics) == set(metrics)
                for key in trl_metrics:
                    assert metrics[key] == pytest.approx(trl_metrics[key], rel=1e-6, abs=1e-7), key
        counts = _patch.call_counts()
    assert clipped > 0  # the clip branches were exercised
    n = sum(len(rows) for rows, _ in batches)
    assert counts["trl.async_grpo.compute_loss"] == n
    assert counts["trl.async_grpo.tree_attention[rk_tree_sdpa]"] == counts["trl.async_grpo.tree_attention"] > 0
    assert "trl.async_grpo.compute_loss[trl]" not in counts


def test_unsupported_option_raises_or_falls_back_to_trl_once(env):
    trainer = env["trainer"]
    _, batch = _planner_batches(defaultdict(list))[0]
    inputs = _rank_inputs(batch, 0)
    trl_compute_loss = async_grpo.AsyncGRPOTrainer.compute_loss.__wrapped__
    old = trainer.epsilon_high
    trainer.epsilon_high = -0.1
    try:
        with pytest.raises(NotImplementedError, match="epsilon_high"):
            async_grpo.AsyncGRPOTrainer.compute_loss(trainer, trainer.model, inputs)
        lenient = AP._make_compute_loss(trl_compute_loss, strict=False)
        with _counting(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_a = lenient(trainer, trainer.model, inputs)
            loss_b = lenient(trainer, trainer.model, inputs)
            counts = _patch.call_counts()
        ours = [w for w in caught if "epsilon_high" in str(w.message)]
        assert len(ours) == 1 and "TRL's own compute_loss" in str(ours[0].message)
        assert counts["trl.async_grpo.compute_loss[trl]"] == 2
        assert "trl.async_grpo.compute_loss" not in counts
        expected = trl_compute_loss(trainer, trainer.model, inputs)
        assert torch.equal(loss_a.detach(), expected.detach()) and torch.equal(loss_b.detach(), expected.detach())
    finally:
        trainer.epsilon_high = old


def _train(env, compute_loss, initial):
    """One optimizer step of ``trainer.train()`` (2 micro-batches), TRL's whole loop: the
    rollout queue, its dataset, planner, collator, dispatcher, training_step, SGD; the
    samples arrive as TRL's rollout worker sends them (RolloutSample, numpy arrays)."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    trainer, q = env["trainer"], env["worker"].rollout_buffer
    trainer.model.load_state_dict(initial)
    trainer.optimizer = trainer.lr_scheduler = None
    trainer._metrics["train"].clear()  # what earlier compute_loss calls left in TRL's sinks
    for counter in ("_step_forward_s", "_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted"):
        setattr(trainer, counter, 0.0)
    trainer._step_samples = 0.0
    while not q.empty():
        q.get_nowait()
    for seed in (0, 1, 2):  # more than the step takes: the dispatcher fetches one batch ahead
        for s in _samples(seed, n_groups=8):
            q.put(
                RolloutSample(
                    prompt=[],
                    completion=[],
                    input_ids=s["input_ids"].numpy(),
                    completion_mask=s["completion_mask"].numpy(),
                    old_log_probs=s["old_log_probs"].numpy(),
                    advantage=float(s["advantage"]),
                    model_version=trainer.model_version,
                    group_id=int(s["group_id"]) + 100 * seed,
                    metrics=s["metrics"],
                )
            )
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.setattr(async_grpo.AsyncGRPOTrainer, "compute_loss", compute_loss)
        trainer.train()
    assert trainer.state.global_step == 1
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return params, trainer.state.log_history[0]


def test_train_runs_on_cpu_and_steps_as_trls_loss(env):
    """trainer.train() itself runs on CPU once applied (TRL's FA3 cannot), and one step
    with the fused loss moves the parameters as TRL's own loss does (on our attention and
    TreeRow), with the same logged loss and metrics."""
    trainer = env["trainer"]
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    fused = async_grpo.AsyncGRPOTrainer.compute_loss
    try:
        with _counting():
            ours, our_log = _train(env, fused, initial)
            counts = _patch.call_counts()
        theirs, their_log = _train(env, fused.__wrapped__, initial)
    finally:
        trainer.model.load_state_dict(initial)
        trainer.optimizer = trainer.lr_scheduler = None
    assert counts["trl.async_grpo.compute_loss"] == GA_STEPS
    assert counts["trl.async_grpo.TreeRow.pack"] >= GA_STEPS
    assert counts["trl.async_grpo.tree_attention[rk_tree_sdpa]"] > 0
    for name, p in theirs.items():
        update = (p - initial[name]).abs().max()
        assert update > 0, name
        # 1e-5 of the update, plus the rounding of the parameter itself
        assert (ours[name] - p).abs().max() <= 1e-5 * update + 2e-7 * p.abs().max(), name
    for key in ("loss", *METRICS):
        assert our_log[key] == pytest.approx(their_log[key], rel=1e-5, abs=1e-7), key


def test_a_row_with_nothing_trained_gives_a_zero_loss(env):
    """A row whose samples have no trained token (TRL's own compute_loss raises there, on
    ``segment_id.max()`` of nothing): a differentiable zero loss, zero gradients, NaN
    means (which TRL's log() drops), and the step accounting still counts the row."""
    trainer = env["trainer"]
    samples = [dict(s, completion_mask=torch.zeros_like(s["completion_mask"])) for s in _samples()[:3]]
    row = async_grpo.TreeRow()
    for s in samples:
        row.add(s)
    batch = async_grpo.DataCollatorForRollout(pad_token_id=0, num_processes=1).torch_call([[row]])
    assert batch["token_index"].numel() == 0
    loss, grads, metrics = _run(trainer, async_grpo.AsyncGRPOTrainer.compute_loss, batch)
    assert loss.item() == 0.0 and all(not g.any() for g in grads.values())
    assert all(metrics[k] != metrics[k] for k in METRICS)  # NaN
    with pytest.raises(RuntimeError):
        async_grpo.AsyncGRPOTrainer.compute_loss.__wrapped__(trainer, trainer.model, batch)
