"""One training step of TRL's real ``GRPOTrainer``, stock vs ``integrations.trl.apply()``.

Generation dominates a GRPO step and is the same either way, so the step timed here is
the training part on a fixed prepared micro-batch: ``trainer.compute_loss(model, batch)``
(the policy forward through TRL's fused LM head, the loss, TRL's metrics) and
``loss.backward()``. The model is a Qwen2 built from a config (no download) where the LM
head and the loss are a visible part of the step: vocab 32k, hidden 512, 2 layers, 8
completions of 256 tokens after 64-token prompts (``quick``: a smoke-test size).

Rows: TRL stock; applied (the fused log-probs with the compact head on the CPU, the fused
advantages and loss); applied with ``compact_logprobs=False`` (every position through the
head, as stock TRL does off Triton devices). Peak memory: each row once in a fresh process.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .timing import in_fresh_processes, peak_extra_gb, time_fn

# key -> (label, apply() switches or None for stock)
METHODS: Dict[str, Tuple[str, Any]] = {
    "trl": ("TRL 1.16 GRPOTrainer, stock (chunked LM head, _compute_loss)", None),
    "fused": ("GRPOTrainer after rlvr_kernels.integrations.trl.apply()", {}),
    "fused_full_head": ("apply(compact_logprobs=False): every position through the head", {"compact_logprobs": False}),
}


def shape(quick: bool) -> Dict[str, int]:
    if quick:
        return dict(V=2048, H=64, layers=1, B=4, P=16, C=32)
    return dict(V=32000, H=512, layers=2, B=8, P=64, C=256)


def qwen2_config(s: Dict[str, int]):
    """The benchmark's Qwen2 config for a :func:`shape` (no download; fp32 weights)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=s["V"],
        hidden_size=s["H"],
        intermediate_size=2 * s["H"],
        num_hidden_layers=s["layers"],
        num_attention_heads=8 if s["H"] >= 256 else 4,
        num_key_value_heads=2,
        max_position_embeddings=s["P"] + s["C"] + 8,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )


def build(device: str, quick: bool, loss_type: str = "dapo", seed: int = 0):
    """(trainer, model, batch): a GRPOTrainer on a config-built Qwen2 and one prepared
    micro-batch as ``_compute_loss`` receives it (random completions of random lengths,
    old log-probs off the current ones so that the ratios clip)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    s = shape(quick)
    torch.manual_seed(seed)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate("abcdefghij")}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    model = Qwen2ForCausalLM(qwen2_config(s)).to(device)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rlvr-bench-trainer-"),
        report_to=[],
        save_strategy="no",
        use_cpu=device == "cpu",
        bf16=False,
        per_device_train_batch_size=s["B"],
        num_generations=s["B"],
        max_completion_length=s["C"],
        loss_type=loss_type,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * s["B"]}),
        processing_class=tok,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
    g = torch.Generator().manual_seed(seed)
    B, P, C, V = s["B"], s["P"], s["C"], s["V"]
    lengths = torch.randint(C // 4, C + 1, (B,), generator=g)
    completion_mask = (torch.arange(C)[None, :] < lengths[:, None]).long()
    batch = {
        "prompt_ids": torch.randint(3, V, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, V, (B, C), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    batch["old_per_token_logps"] = logps + 0.2 * torch.randn(logps.shape, generator=g).to(device)
    return trainer, trainer.model, batch


def step_fn(trainer, model, batch) -> Callable[[], float]:
    def step():
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        return float(loss.detach())

    return step


def switch_to(switches: Optional[Dict[str, Any]], apply: Callable[..., None], unapply: Callable[[], None]) -> None:
    """A method's integration state: stock (``switches`` None) or ``apply(**switches)``."""
    if switches is None:
        unapply()
    else:
        apply(**switches)


def _switch(key: str) -> None:
    from ..integrations import trl as rk_trl

    switch_to(METHODS[key][1], functools.partial(rk_trl.apply, async_grpo=False), rk_trl.unapply)


def measure_memory(key: str, device: str, quick: bool) -> Dict:
    """Peak extra memory of one step of ``key`` (a fresh process, see ``memory_rows``)."""
    _switch(key)
    trainer, model, batch = build(device, quick)
    step = step_fn(trainer, model, batch)
    return {"extra_gb": peak_extra_gb(step, device)}


def memory_rows(device: str, quick: bool, module: str = __name__, methods=METHODS) -> Dict[str, Dict]:
    """``module.measure_memory(key, device, quick)`` for each key of ``methods``
    (:func:`in_fresh_processes`)."""
    keys = list(methods)
    calls = [(key, device, quick) for key in keys]
    return dict(zip(keys, in_fresh_processes(module, "measure_memory", calls, quick)))


def interleaved(
    methods, switch: Callable[[str], None], make_step: Callable[[], Callable[[], float]], device: str, repeats: int
) -> Tuple[Dict[str, float], Dict[str, List[float]]]:
    """(the loss each method's first call returns, its times over ``repeats`` interleaved
    rounds): ``switch(key)`` then a fresh ``make_step()`` for every call (a step binds the
    patched functions when it is made)."""
    losses, times = {}, {key: [] for key in methods}
    for key in methods:  # warm-up and the loss each computes
        switch(key)
        losses[key] = make_step()()
    for _ in range(repeats):  # interleaved rounds
        for key in methods:
            switch(key)
            times[key].append(time_fn(make_step(), device, repeats=1, warmup=0)["ms"])
    return losses, times


def method_rows(methods, times: Dict[str, List[float]], memory: Dict[str, Dict], base: str = "fused") -> List[Dict]:
    """One row a method: the median time, its ratio to ``base``'s, the fresh-process peak."""

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    rows = []
    for key, (label, _) in methods.items():
        ms = median(times[key])
        rows.append(
            {
                "method": label,
                "key": key,
                "ms": ms,
                "ratio": ms / median(times[base]),
                "extra_gb": memory[key].get("extra_gb"),
            }
        )
    return rows


def workload(device: str, quick: bool = False) -> Dict:
    from ..integrations import trl as rk_trl

    s = shape(quick)
    was_applied = rk_trl.applied_options()
    trainer, model, batch = build(device, quick)

    def restore():
        rk_trl.unapply()
        if was_applied:
            rk_trl.apply(**was_applied)

    rows, losses, rounds = run_methods(
        METHODS, _switch, lambda: step_fn(trainer, model, batch), restore, device, quick, __name__
    )
    step = (
        f"{s['B']} completions of up to {s['C']} tokens after {s['P']}-token prompts; loss_type dapo, fp32; "
        f"one step = compute_loss + backward on a fixed prepared micro-batch (generation excluded); median of "
        f"{rounds} interleaved rounds"
    )
    title = f"one GRPOTrainer training step (compute_loss + backward), V={s['V']}, H={s['H']}, B={s['B']}, completions"
    return step_result(title, quick, rows, losses, [model_note(s) + step, MEMORY_NOTE], stock="trl")


MEMORY_NOTE = (
    "extra memory: each row once in a fresh process (on the CPU the peak RSS above the RSS before the step, "
    "the heap's free pages given back to the OS first)"
)


def model_note(s: Dict[str, int]) -> str:
    return f"Qwen2 from a config: vocab {s['V']}, hidden {s['H']}, {s['layers']} layers; "


def run_methods(
    methods, switch, make_step, restore: Callable[[], None], device: str, quick: bool, module: str
) -> Tuple[List[Dict], Dict[str, float], int]:
    """(rows, the loss of each method, the number of rounds): :func:`interleaved` (then
    ``restore()``, whatever happened) and the fresh-process memory of ``module``'s methods."""
    try:
        losses, times = interleaved(methods, switch, make_step, device, repeats=2 if quick else 5)
    finally:
        restore()
    rows = method_rows(methods, times, memory_rows(device, quick, module, methods))
    return rows, losses, len(times["fused"])


def step_result(title: str, quick: bool, rows: List[Dict], losses: Dict[str, float], notes: List[str], stock: str):
    """A step workload's result: the rows, the stock / applied ("fused") time ratio, the notes
    and last the loss agreement of every method with ``stock``; ``title`` ends with what the
    last size (the completion length) counts."""
    ms = {r["key"]: r["ms"] for r in rows}
    agreement = ", ".join(f"{k} {abs(v - losses[stock]):.1e}" for k, v in losses.items() if k != stock)
    s = shape(quick)
    return {
        "name": f"{'quick' if quick else 'standard'}: {title} {s['C']}",
        "rows": rows,
        "targets": [{"target": "stock / applied step time", "measured": ms[stock] / ms["fused"], "met": "info"}],
        "notes": notes + [f"loss agreement with stock: {agreement}"],
    }


def head_floor(step: Callable[[], object], device: str, quick: bool) -> Dict[str, float]:
    """Where the applied logit-free step (``step``, with the head's gradient formed in the
    forward) spends its time: ``head_ms`` in the head (the profiler range
    "rlvr_kernels.head_grad_in_forward[<rows>x<vocab>]" of the integrations' head, which forms
    every gradient of the head; its backward only returns them), ``rest_ms`` the rest of the
    step (its time unprofiled less the head's), ``rows`` through the head, and ``gemms_ms`` the
    three ``[rows, H] x [H, V]`` GEMMs of those rows timed on their own (torch.mm at this
    machine's rate): an exact step cannot take less than ``rest_ms + gemms_ms``. Medians."""
    from torch.profiler import ProfilerActivity, profile

    repeats = 2 if quick else 5
    total = time_fn(step, device, repeats=repeats, warmup=1)["ms"]
    heads, rows, vocab = [], 0, 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for _ in range(repeats):
        with profile(activities=activities) as prof:
            step()
            _sync(device)
        ranges = [e for e in prof.events() if e.name.startswith("rlvr_kernels.head_grad_in_forward[")]
        if not ranges:
            raise RuntimeError("head_floor: the step did not form the head's gradient in the forward")
        heads.append(sum(e.cpu_time_total for e in ranges) / 1e3)
        rows, vocab = (int(x) for x in ranges[0].name.split("[")[1].rstrip("]").split("x"))
    hidden = torch.randn(rows, shape(quick)["H"], device=device)
    weight = torch.randn(vocab, hidden.shape[1], device=device)

    def gemms():
        logits = hidden @ weight.t()
        logits @ weight
        logits.t() @ hidden

    head = statistics.median(heads)
    return {
        "head_ms": head,
        "rest_ms": total - head,
        "rows": rows,
        "hidden": hidden.shape[1],
        "vocab": vocab,
        "gemms_ms": time_fn(gemms, device, repeats=repeats)["ms"],
    }


def floor_target(floor: Dict[str, float], stock_ms: float) -> Tuple[Dict, str]:
    """The step-time bound an exact logit-free step has on this machine, and its note."""
    bound = stock_ms / (floor["rest_ms"] + floor["gemms_ms"])
    gflops = 3 * 2 * floor["rows"] * floor["hidden"] * floor["vocab"] / floor["gemms_ms"] / 1e6
    note = (
        f"the applied step's head: {floor['head_ms']:.0f} ms for {floor['rows']} rows (its three GEMMs alone "
        f"{floor['gemms_ms']:.0f} ms, {gflops:.0f} GFLOP/s), the rest of the step {floor['rest_ms']:.0f} ms: an exact "
        f"step takes at least the rest + those GEMMs, at most {bound:.2f}x stock's time on this machine (measured "
        "after the rounds)"
    )
    return {
        "target": "bound: stock / (rest of the step + three GEMMs of the head rows)",
        "measured": bound,
        "met": "info",
    }, note


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


WORKLOADS: Dict[str, Callable] = {"grpo_trainer_step": workload}
