"""A hybrid model in TRL 1.16's AsyncGRPOTrainer under ``async_targets()`` (what
``integrations.trl.apply()`` installs): a tiny Qwen3.5 (three Gated DeltaNet layers, one
full-attention layer) saved from a config. Stock TRL refuses it; applied, the trainer builds
on CPU, its compute_loss on TRL's own packed micro-batches gives each sample's unpacked loss
and gradients, and one optimizer step of ``trainer.train()`` runs and moves every layer."""

from __future__ import annotations

import warnings
from collections import defaultdict

import pytest
import torch
from packing.test_hf_linear import COMMON, slow_decays

from rlvr_kernels.integrations import _patch

from .test_trl_async_apply import (
    GA_STEPS,
    VOCAB,
    _counting,
    _planner_batches,
    _rank_inputs,
    _reference,
    _run,
    _train,
    _Worker,
    applied_env,
    async_grpo,
    build_trainer,
)

pytestmark = [
    pytest.mark.cpu_kernel,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _save_model(path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**{**COMMON, "vocab_size": VOCAB, "max_position_embeddings": 64})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen3_5ForCausalLM(cfg)
    slow_decays(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # logits of order one, so the ratios to old_log_probs spread
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_grpo_hybrid")
    _save_model(tmp / "model")
    with pytest.raises(ValueError, match=r"\['linear_attention'\] layers"):  # stock TRL refuses it
        build_trainer(tmp, _Worker())
    yield from applied_env(tmp)


def test_trainer_builds_on_the_hybrid_model_with_its_true_layer_kinds(env):
    trainer = env["trainer"]
    assert env["init_counts"]["trl.async_grpo.create_model_from_path"] == 1
    assert trainer.model.config.layer_types.count("linear_attention") == 3  # put back after TRL's check
    assert "_rk_tree_layer_types" not in vars(trainer.model)
    with pytest.raises(ValueError, match=r"Qwen3_5GatedDeltaNet \(layer 0\).*'tree_fa3'"):
        trainer.model(input_ids=torch.tensor([[3, 4, 5]]))  # unpacked on the packed model: refused


def test_compute_loss_matches_each_sample_alone(env):
    """Every rank-row of every micro-batch of TRL's planner: the applied compute_loss gives
    the loss and gradients of each sample run alone, unpacked, through the model's own
    PyTorch recurrence."""
    from transformers import Qwen3_5ForCausalLM

    trainer = env["trainer"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_model = Qwen3_5ForCausalLM.from_pretrained(env["path"], attn_implementation="eager").float()
    batches = _planner_batches(defaultdict(list))
    shared = 0
    with _counting():
        for rows, batch in batches:
            for rank, samples in enumerate(rows):
                inputs = _rank_inputs(batch, rank)
                # a segment with ancestors: the paths hold more entries than the row has tokens
                shared += int((inputs["tree_kv_index"] >= 0).sum() > inputs["attention_mask"].sum())
                loss, grads, _ = _run(trainer, async_grpo.AsyncGRPOTrainer.compute_loss, inputs)
                ref_loss, ref_grads, _ = _reference(ref_model, samples, batch["global_n_tokens"][0])
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
                for name, g in ref_grads.items():
                    torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
        counts = _patch.call_counts()
    assert shared > 0
    assert counts["trl.async_grpo.tree_attention[rk_tree_sdpa]"] > 0


def test_train_one_step_on_cpu(env):
    trainer = env["trainer"]
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    try:
        with _counting():
            params, log = _train(env, async_grpo.AsyncGRPOTrainer.compute_loss, initial)
            counts = _patch.call_counts()
    finally:
        trainer.model.load_state_dict(initial)
        trainer.optimizer = trainer.lr_scheduler = None
    assert counts["trl.async_grpo.compute_loss"] == GA_STEPS
    assert torch.isfinite(torch.tensor(log["loss"]))
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.3.self_attn.q_proj.weight"):
        assert (params[name] - initial[name]).abs().max() > 0, name
