"""Runs TRL's real ``GRPOTrainer`` (TRL 1.16) on a tiny Qwen2 with an in-memory character
tokenizer, stock or with ``rlvr_kernels.integrations.trl.apply()``, for many
configurations in one process (the imports take most of the time), and saves what
tests/integrations/test_trl_apply.py compares: generations, every micro-batch loss, the
logged metrics, θ_0 and the final parameters, the call counts.

    python tests/integrations/trl_grpo_runner.py {stock|applied|unapplied} OUT.pt NAME [NAME ...]

``applied``: ``apply(strict=<config's>, count_calls=True)`` before each
trainer is built; ``unapplied``: apply() then unapply() before the stock run. CPU only,
nothing downloaded, nothing saved but OUT.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from typing import Any, Dict

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

SEED = 1234
CHARS = "abcdefghijklmnopqrstuvwxyz "
PROMPTS = ["abc", "hello", "xyz q", "grpo", "aaab", "token", "mn", "kernels"]

# name -> (GRPOConfig overrides, runner options). Options: strict (apply's), expect_error
# (the applied build must raise NotImplementedError mentioning this), rewards ("one" | "two"),
# autocast (bf16: compared by the tolerance rule against the fp32 run, not to 1e-6),
# eval (an eval dataset: TRL's eval mode of the loss).
BASE = dict(
    max_steps=4,
    per_device_train_batch_size=4,
    num_generations=4,
    steps_per_generation=2,
    max_completion_length=8,
    learning_rate=3e-2,
    epsilon=0.05,
    beta=0.0,
    temperature=1.0,
    # fp32: TRL's default bf16=True autocasts on the CPU too, which rounds TRL's LM-head
    # matmul to bf16 (the fused op computes it in the hidden states' fp32).
    bf16=False,
)
CONFIGS: Dict[str, Any] = {
    "grpo": (dict(loss_type="grpo"), {}),
    "bnpo": (dict(loss_type="bnpo"), {}),
    "dr_grpo": (dict(loss_type="dr_grpo"), {}),
    "dapo": (dict(loss_type="dapo"), {}),
    "luspo": (dict(loss_type="luspo", importance_sampling_level="sequence"), {}),
    "cispo": (dict(loss_type="cispo", epsilon_high=1.05), {}),
    "sapo": (dict(loss_type="sapo"), {}),
    "gspo": (dict(loss_type="grpo", importance_sampling_level="sequence"), {}),
    "grpo_beta": (dict(loss_type="grpo", beta=0.04), {}),  # TRL's default bias-corrected KL
    "grpo_beta_plain_kl": (dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False), {}),
    "gspo_beta": (dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04), {}),
    "vespo": (dict(loss_type="vespo"), {}),
    # TRL's default bf16=True: autocast on the CPU too (compared with the fp32 "dapo" run).
    "bf16_autocast": (dict(loss_type="dapo", bf16=True), {"autocast": True}),
    "cispo_seq": (dict(loss_type="cispo", epsilon_high=1.05, importance_sampling_level="sequence"), {}),
    "sapo_seq": (dict(loss_type="sapo", importance_sampling_level="sequence"), {}),
    "delta_inside_clip": (dict(loss_type="bnpo", delta=1.02), {}),
    "gspo_delta": (dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5), {}),
    "off_policy_mask": (dict(loss_type="dapo", off_policy_mask_threshold=1e-4), {}),
    "dapo_beta_delta": (dict(loss_type="dapo", beta=0.1, delta=1.5), {}),
    "grad_accum": (dict(loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=4), {}),
    "num_iterations": (dict(loss_type="grpo", num_iterations=2), {}),
    "top_entropy": (dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01), {}),
    "masked_truncated": (dict(loss_type="grpo", max_completion_length=3, mask_truncated_completions=True), {}),
    "masked_dapo_batch": (
        dict(loss_type="dapo", mask_truncated_completions=True, scale_rewards="batch"),
        {},
    ),
    "two_rewards": (
        dict(loss_type="bnpo", multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5]),
        {"rewards": "two"},
    ),
    "entropy_beta_accum": (
        dict(
            loss_type="grpo",
            beta=0.04,
            entropy_coef=0.01,
            gradient_accumulation_steps=2,
            steps_per_generation=4,
        ),
        {},
    ),
    "eval": (
        dict(loss_type="bnpo", eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4),
        {"eval": True},
    ),
    "adaptive_entropy": (dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=5.0), {}),
    # delta < 1 (TRL clamps the unclipped ratio below 1): not fused, the clip bound would be negative.
    "delta_below_one_fallback": (dict(loss_type="grpo", delta=0.9), {"strict": False}),
    "delta_below_one_strict": (dict(loss_type="grpo", delta=0.9, max_steps=1), {"expect_error": "delta"}),
}


def tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    # BPE without merges and without a pre-tokenizer: one token per character.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    out.padding_side = "left"
    return out


def model(tok):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(cfg)


def grpo_config(output_dir: str, **kw):
    """A GRPOConfig for the CPU runs: no logging backends, nothing saved, transformers'
    generate, the runner's seed; ``kw`` the configuration's fields."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=SEED,
        use_vllm=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **kw,
    )


def reward_letters(completions, **kwargs):
    return [(c.count("a") + c.count("e") + 0.5 * c.count(" ") - 0.25 * len(c)) for c in completions]


def reward_sometimes(completions, **kwargs):
    # None for some completions (that function did not apply), all None for none of them.
    return [None if len(c) % 3 == 0 else float(len(set(c))) for c in completions]


def run_one(name: str, mode: str) -> Dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOTrainer

    from rlvr_kernels.integrations import trl as rk_trl
    from rlvr_kernels.integrations._patch import call_counts, reset_call_counts

    overrides, opts = CONFIGS[name]
    kw = {**BASE, **overrides}
    probe: Dict[str, list] = {"losses": [], "completions": [], "masks": [], "advantages": [], "training": []}

    class Probe(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            probe["losses"].append(loss.detach().double().item())
            probe["training"].append(bool(self.model.training))
            probe["completions"].append(inputs["completion_ids"].tolist())
            probe["masks"].append(inputs["completion_mask"].tolist())
            probe["advantages"].append(inputs["advantages"].double().tolist())
            return loss

    if mode == "applied":
        switches = {**opts.get("apply", {}), **json.loads(os.environ.get("RK_TRL_APPLY", "{}"))}
        rk_trl.apply(strict=opts.get("strict", True), count_calls=True, **switches)
    elif rk_trl.is_applied():
        rk_trl.unapply()
    reset_call_counts()
    _SPY.clear()

    tok = tokenizer()
    net = model(tok)
    theta0 = {k: v.detach().clone() for k, v in net.named_parameters()}
    funcs = [reward_letters, reward_sometimes] if opts.get("rewards") == "two" else [reward_letters]
    ds = Dataset.from_dict({"prompt": PROMPTS})
    result: Dict[str, Any] = {"name": name, "mode": mode}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = grpo_config(tmp, **kw)
        model_arg = net
        if kw.get("beta", 0.0) != 0.0:
            # TRL loads the reference model by name: hand it a local copy (temporary, no download).
            net.save_pretrained(os.path.join(tmp, "tiny"))
            tok.save_pretrained(os.path.join(tmp, "tiny"))
            model_arg = os.path.join(tmp, "tiny")
        try:
            eval_ds = Dataset.from_dict({"prompt": PROMPTS[:2]}) if opts.get("eval") else None
            trainer = Probe(
                model=model_arg,
                reward_funcs=funcs,
                args=args,
                train_dataset=ds,
                eval_dataset=eval_ds,
                processing_class=tok,
            )
            trainer.train()
        except NotImplementedError as e:
            result["error"] = str(e)
            result["counts"] = dict(call_counts(), **_SPY)
            return result
        result["warnings"] = [str(w.message) for w in caught if "rlvr_kernels" in str(w.message)]
    result.update(probe)
    result["logs"] = [dict(entry) for entry in trainer.state.log_history]
    result["theta0"] = theta0
    result["theta"] = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    result["counts"] = dict(call_counts(), **_SPY)
    return result


_SPY: Dict[str, int] = {}


def install_spies() -> None:
    """Count TRL's own chunked log-prob function and _compute_loss (installed before any
    apply(), so apply() keeps them as the originals and unapply() restores them)."""
    import trl.trainer.utils as utils
    from trl.trainer.grpo_trainer import GRPOTrainer

    chunked = utils._ChunkedLogProbFunction
    forward = chunked.forward

    def counted_forward(*args, **kwargs):
        _SPY["stock:ChunkedLogProbFunction.forward"] = _SPY.get("stock:ChunkedLogProbFunction.forward", 0) + 1
        return forward(*args, **kwargs)

    chunked.forward = staticmethod(counted_forward)
    stock_loss = GRPOTrainer._compute_loss

    def _compute_loss(self, model, inputs):
        _SPY["stock:GRPOTrainer._compute_loss"] = _SPY.get("stock:GRPOTrainer._compute_loss", 0) + 1
        return stock_loss(self, model, inputs)

    GRPOTrainer._compute_loss = _compute_loss


def main(argv) -> None:
    import torch

    mode, out, names = argv[1], argv[2], argv[3:]
    if mode not in ("stock", "applied", "unapplied"):
        raise SystemExit(f"mode: expected stock, applied or unapplied, got {mode!r}")
    torch.set_num_threads(1)
    install_spies()
    if mode == "unapplied":
        from rlvr_kernels.integrations import trl as rk_trl

        rk_trl.apply()
        rk_trl.unapply()
    results = {name: run_one(name, mode) for name in names}
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv)
