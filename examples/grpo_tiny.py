"""GRPO on a verifiable task, end to end on rlvr_kernels' ops, on a CPU in minutes.

The task: sort a list of digits ("^31405>" → "01345."). The checker is the reward: 1 when
the completion is exactly the sorted digits followed by the end token, else 0.

The model: a tiny ``transformers`` Qwen2 built from a config (no download) with a character
tokenizer. RL from random weights gets no reward to learn from, so the run starts, as real
pipelines start from SFT, with a short supervised warm-up on a small share of the data,
stopped as soon as the validation success rate reaches a few percent; the checkpoint is
cached. Then GRPO alone lifts the rate.

One GRPO step:
  1. sample G completions per prompt with temperature (KV-cached decoding, no grad);
  2. rewards from the checker; ``group_advantages`` (GRPO, mean+std per group), dropping the
     degenerate groups (all right or all wrong: dynamic sampling's filter);
  3. the prefix-tree packed forward (each prompt forwarded once for its G completions) and
     ``linear_logprobs`` with entropy straight from the hidden states and the LM head;
  4. ``policy_loss``: PPO with clip-higher and k3 KL to the warm-up model (plus A3PO or
     polarity shaping with ``--shaping``), ``--ppo-epochs`` passes over the batch; Adam.

``--reference`` runs the same loop on the pure-PyTorch reference ops (the same numbers,
slower). ``--async-lag K`` generates in a producer thread up to K policy versions ahead of
training (``rlvr_kernels.async_rollout``), with stale samples dropped or corrected.

    python examples/grpo_tiny.py                 # learns in a few minutes, writes the curves
    python examples/grpo_tiny.py --async-lag 2   # the same with asynchronous rollouts
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

import rlvr_kernels as rk
from rlvr_kernels.packing import forward_packed, pack_prefix_tree

HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------- the task
DIGITS = "0123456789"
SEP, EOS, BOS, PAD = ">", ".", "^", "_"
CHARS = DIGITS + SEP + EOS + BOS + PAD
STOI = {c: i for i, c in enumerate(CHARS)}


def encode(text: str) -> List[int]:
    return [STOI[c] for c in text]


def decode(ids) -> str:
    return "".join(CHARS[int(i)] for i in ids)


@dataclasses.dataclass(frozen=True)
class Config:
    digits: int = 6  # list length
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    warmup_lr: float = 1e-3
    warmup_batch: int = 32
    warmup_max_steps: int = 600
    warmup_target: float = 0.10  # stop the warm-up once validation success reaches this
    warmup_data: int = 200  # the small share of the data the warm-up sees
    prompts: int = 16  # per step
    group: int = 16  # G samples per prompt
    temperature: float = 0.7
    lr: float = 2e-4
    ppo_epochs: int = 2
    clip_low: float = 0.2
    clip_high: float = 0.28
    # k1 | k2 | k3 | k3+: policy_loss's per-token KL estimator in the loss. "seq": the
    # sequence's KL, kl_coef·Σ_t(log π_old − log π_ref), subtracted from its advantage after
    # the group normalisation: the gradient of E[A] − β·KL(π‖π_ref) over whole sequences.
    kl: str = "k3"
    kl_coef: float = 0.01
    steps: int = 500
    val_size: int = 256
    val_every: int = 10
    seed: int = 0

    @property
    def prompt_len(self) -> int:
        return self.digits + 2  # BOS, digits, SEP

    @property
    def max_new(self) -> int:
        return self.digits + 2  # the answer, EOS, one spare


def make_prompts(n: int, cfg: Config, gen: torch.Generator) -> torch.Tensor:
    """[n, digits] random digit lists."""
    return torch.randint(0, 10, (n, cfg.digits), generator=gen)


def prompt_ids(digits: torch.Tensor) -> torch.Tensor:
    n = digits.shape[0]
    return torch.cat([torch.full((n, 1), STOI[BOS]), digits, torch.full((n, 1), STOI[SEP])], dim=1)


def answer_ids(digits: torch.Tensor) -> torch.Tensor:
    n = digits.shape[0]
    return torch.cat([digits.sort(dim=1).values, torch.full((n, 1), STOI[EOS])], dim=1)


def reward(digits: torch.Tensor, completion: List[int]) -> float:
    """The checker: exactly the sorted digits, then the end token."""
    return float(completion == answer_ids(digits[None])[0].tolist())


# ----------------------------------------------------------------------------- the model
def make_model(cfg: Config):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(CHARS),
        hidden_size=cfg.hidden,
        intermediate_size=4 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(cfg.seed)
    return Qwen2ForCausalLM(config).float()


@torch.no_grad()
def sample(model, digits: torch.Tensor, cfg: Config, gen: torch.Generator, greedy: bool = False):
    """Completions (lists of ids up to and including EOS, or ``max_new`` ids) and the
    sampling log-probs of their tokens, for each row of ``digits`` (KV-cached decoding)."""
    model.eval()
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    ids = prompt_ids(digits)
    n = ids.shape[0]
    out = model(input_ids=ids, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    tokens, logps = [], []
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(cfg.max_new):
        logp = torch.log_softmax(logits.float() / (1.0 if greedy else cfg.temperature), dim=-1)
        nxt = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
        nxt = torch.where(done, torch.full_like(nxt, STOI[PAD]), nxt)
        tokens.append(nxt)
        logps.append(logp.gather(1, nxt[:, None])[:, 0])
        done |= nxt == STOI[EOS]
        if bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
    tokens, logps = torch.stack(tokens, 1), torch.stack(logps, 1)
    completions, comp_logps = [], []
    for i in range(n):
        row = tokens[i].tolist()
        length = row.index(STOI[EOS]) + 1 if STOI[EOS] in row else len(row)
        completions.append(row[:length])
        comp_logps.append(logps[i, :length])
    return completions, comp_logps


def success_rate(model, digits: torch.Tensor, cfg: Config) -> float:
    completions, _ = sample(model, digits, cfg, torch.Generator(), greedy=True)
    return sum(reward(d, c) for d, c in zip(digits, completions)) / len(completions)


# ----------------------------------------------------------------------------- warm-up
_WARMUP_FIELDS = ("digits", "hidden", "layers", "heads", "val_size", "seed") + tuple(
    f.name for f in dataclasses.fields(Config) if f.name.startswith("warmup_")
)


def warmup(cfg: Config, val: torch.Tensor, log=print, cache_dir: Optional[str] = None) -> Tuple[object, List[Dict]]:
    """Supervised warm-up on ``warmup_data`` problems until the greedy validation success
    reaches ``warmup_target`` (the checkpoint is cached by config)."""
    # Keyed on what the warm-up depends on only: runs that differ in their GRPO settings share it.
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k in _WARMUP_FIELDS}
    key = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir or os.path.join(HERE, ".cache"), f"grpo_tiny_warmup_{key}.pt")
    model = make_model(cfg)
    if os.path.exists(path):
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        log(f"warm-up: cached checkpoint {os.path.relpath(path)}")
        return model, saved["curve"]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    data = make_prompts(cfg.warmup_data, cfg, gen)
    seqs = torch.cat([prompt_ids(data), answer_ids(data)], dim=1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr)
    curve = []
    for step in range(1, cfg.warmup_max_steps + 1):
        model.train()
        batch = seqs[torch.randint(0, seqs.shape[0], (cfg.warmup_batch,), generator=gen)]
        logits = model(input_ids=batch[:, :-1]).logits[:, cfg.prompt_len - 1 :]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, cfg.prompt_len :].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0:
            acc = success_rate(model, val, cfg)
            curve.append(dict(step=step, val_success=acc, loss=float(loss.detach())))
            log(f"warm-up step {step:4d}  loss {float(loss.detach()):.3f}  validation success {acc:.3f}")
            if acc >= cfg.warmup_target:
                break
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(model=model.state_dict(), curve=curve), path)
    return model, curve


# ----------------------------------------------------------------------------- GRPO
@dataclasses.dataclass
class Rollouts:
    """One step's samples: G completions for each prompt, group-major."""

    digits: torch.Tensor  # [n, digits] the prompts
    completions: List[List[int]]  # n·G completions
    logps: List[torch.Tensor]  # their sampling log-probs
    rewards: torch.Tensor  # [n·G]
    version_min: Optional[torch.Tensor] = None  # [n·G] the policy versions that generated them
    version_max: Optional[torch.Tensor] = None


def generate(model, cfg: Config, gen: torch.Generator) -> Rollouts:
    digits = make_prompts(cfg.prompts, cfg, gen)
    rep = digits.repeat_interleave(cfg.group, dim=0)
    completions, logps = sample(model, rep, cfg, gen)
    rewards = torch.tensor([reward(d, c) for d, c in zip(rep, completions)])
    return Rollouts(digits, completions, logps, rewards)


def _ops_backend(reference: bool) -> str:
    return "reference" if reference else "auto"


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] Σ_t (log π − log π_ref) over each sequence of a packed ``[T]`` layout: the k1
    estimate of the sequence's KL(π‖π_ref) from the sample itself."""
    csum = torch.nn.functional.pad((logprobs - ref_logprobs).cumsum(0), (1, 0))
    return csum[cu_seqlens[1:]] - csum[cu_seqlens[:-1]]


def train_step(
    model,
    ref_model,
    opt,
    ro: Rollouts,
    cfg: Config,
    *,
    reference: bool = False,
    shaping=None,
    keep: Optional[torch.Tensor] = None,
    correct: Optional[torch.Tensor] = None,
) -> Dict[str, float]:
    """One GRPO update on ``ro``: advantages, the packed forward, the loss, ``ppo_epochs``
    Adam steps. ``keep`` drops samples (stale ones under ``--async-lag``); ``correct`` marks
    those whose generator is older than the current weights: their old log-probs are then
    recomputed under the current weights and the sampling ones become ``rollout_logprobs``
    (decoupled PPO's importance correction)."""
    backend = _ops_backend(reference)
    n = ro.rewards.shape[0]
    group_index = torch.arange(n) // cfg.group
    sample_mask = None if keep is None else keep
    adv = rk.group_advantages(
        ro.rewards,
        group_index=group_index,
        num_groups=cfg.prompts,
        estimator="grpo",
        sample_mask=sample_mask,
        backend=backend,
    )
    chosen = adv.sample_keep.nonzero()[:, 0]  # dynamic sampling: only groups with a signal
    stats = dict(
        reward=float(ro.rewards.mean()),
        kept_groups=int(group_index[chosen].unique().numel()),
        length=sum(len(c) for c in ro.completions) / n,
    )
    if chosen.numel() == 0:  # nothing to learn from this batch: no update
        return dict(stats, loss=0.0, entropy=float("nan"), clipfrac=0.0, kl=0.0)
    idx = chosen.tolist()
    prompts = prompt_ids(ro.digits.repeat_interleave(cfg.group, dim=0)[chosen])
    samples = [torch.cat([prompts[j], torch.tensor(ro.completions[i])]) for j, i in enumerate(idx)]
    pack = pack_prefix_tree(samples, completion_start=cfg.prompt_len, group_index=group_index[chosen], key="token")
    sampled = torch.cat([ro.logps[i] for i in idx])
    advantages = adv.advantages[chosen]

    def logprobs(m, grad: bool):
        with torch.set_grad_enabled(grad):
            hidden = forward_packed(m, pack, attn_implementation="rk_tree_sdpa")
            out = rk.linear_logprobs(
                hidden,
                m.get_output_embeddings().weight,
                pack.target_ids,
                row_index=pack.token_index,
                temperature=cfg.temperature,  # the sampling distribution's log-probs
                return_entropy=True,
                backend=backend,
            )
            # Entropy is per forwarded position; a shared branch position predicts several
            # targets, so it is read per target.
            return out.logp, out.entropy[pack.token_index]

    ref_logp, _ = logprobs(ref_model, False)
    if cfg.kl == "seq":  # a per-sequence constant, like a KL folded into the reward
        advantages = advantages - cfg.kl_coef * sequence_kl(sampled, ref_logp, pack.cu_seqlens)
    rollout = None
    old = sampled
    if correct is not None and bool(correct[chosen].any()):
        old = logprobs(model, False)[0].detach()  # the proximal policy: the current weights
        rollout = sampled
    metrics = {}
    for _ in range(cfg.ppo_epochs):
        model.train()
        logp, entropy = logprobs(model, True)
        loss, m = rk.policy_loss(
            logp,
            old,
            advantages,
            cu_seqlens=pack.cu_seqlens,
            loss_type="ppo",
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            kl=None if cfg.kl == "seq" else cfg.kl,
            kl_coef=0.0 if cfg.kl == "seq" else cfg.kl_coef,
            ref_logprobs=None if cfg.kl == "seq" else ref_logp,
            entropy=entropy.detach(),
            shaping=shaping,
            agg="token-mean",
            rollout_logprobs=rollout,
            rollout_correction=None if rollout is None else "decoupled",
            backend=backend,
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics.setdefault("loss", float(loss.detach()))
        metrics["clipfrac"] = float(m.pg_clipfrac)
        metrics["entropy"] = float(m.entropy_mean)
        # "seq": the k1 estimate of the per-token KL of the sampling policy to the reference.
        metrics["kl"] = float((sampled - ref_logp).mean()) if cfg.kl == "seq" else float(m.kl)
    return dict(stats, **metrics)


KL_CHOICES = ("k1", "k2", "k3", "k3+", "seq")

SHAPINGS = {
    "none": None,
    # Sample polarity: shrink the push on the high-probability tokens of correct answers and
    # on the low-probability tokens of wrong ones (the seed's teaching model at λ = 1).
    "polarity": dict(probability=1.0),
    # A3PO: scale up the 20% lowest-probability tokens of correct answers and the 20%
    # highest-probability tokens of wrong ones.
    "a3po": dict(a3po_pos_low=(0.2, 2.0), a3po_neg_high=(0.2, 2.0)),
}


def make_shaping(name: str):
    if name not in SHAPINGS:
        raise ValueError(f"--shaping: expected one of {sorted(SHAPINGS)}, got {name!r}")
    return None if SHAPINGS[name] is None else rk.TokenShaping(**SHAPINGS[name])


def run(
    cfg: Config,
    *,
    reference: bool = False,
    shaping: str = "none",
    async_lag: Optional[int] = None,
    stale: str = "drop",
    max_lag: Optional[int] = None,
    log=print,
    progress: bool = True,
    cache_dir: Optional[str] = None,
    keep_model: bool = False,
) -> Dict:
    """Warm-up (cached in ``cache_dir``, default ``examples/.cache``), then ``cfg.steps``
    GRPO steps; returns the history (and the trained model with ``keep_model``)."""
    if cfg.kl not in KL_CHOICES:
        raise ValueError(f"Config.kl: expected one of {KL_CHOICES}, got {cfg.kl!r}")
    val = make_prompts(cfg.val_size, cfg, torch.Generator().manual_seed(10_000 + cfg.seed))
    model, warm_curve = warmup(cfg, val, log=log, cache_dir=cache_dir)
    ref_model = make_model(cfg)
    ref_model.load_state_dict(model.state_dict())
    ref_model.eval().requires_grad_(False)
    # eps 1e-6, not 1e-8: a weight whose exact gradient is ~0 gets rounding noise, which Adam
    # would otherwise normalise into full-size steps of random sign.
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-6)
    shaping_opts = make_shaping(shaping)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    torch.manual_seed(cfg.seed + 3)
    history: List[Dict] = []
    t0 = time.time()
    acc = success_rate(model, val, cfg)
    history.append(dict(step=0, val_success=acc, time=0.0))
    log(f"GRPO start: validation success {acc:.3f}")
    bar = _bar(cfg.steps, progress)

    def after_update(step: int, row: Dict) -> None:
        row.update(step=step, time=time.time() - t0)
        if step % cfg.val_every == 0 or step == cfg.steps:
            row["val_success"] = success_rate(model, val, cfg)
        history.append(row)
        log(_line(row))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward']:.2f}", val=f"{_last(history, 'val_success'):.2f}")

    if async_lag is None:
        for step in range(1, cfg.steps + 1):
            ro = generate(model, cfg, gen)
            after_update(step, train_step(model, ref_model, opt, ro, cfg, reference=reference, shaping=shaping_opts))
    else:
        _async_loop(model, ref_model, opt, cfg, gen, async_lag, stale, max_lag, reference, shaping_opts, after_update)
    if bar is not None:
        bar.close()
    return dict(
        config=dataclasses.asdict(cfg),
        warmup=warm_curve,
        history=history,
        reference=reference,
        shaping=shaping,
        async_lag=async_lag,
        **(dict(model=model) if keep_model else {}),
    )


def _snapshot(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _async_loop(model, ref_model, opt, cfg, gen, lag, stale, max_lag, reference, shaping, after_update) -> None:
    """Training step i (0-based) trains at policy version i (i updates applied) on a batch that
    a producer thread generated, on its own copy of the weights, with a version ≥ i − lag.
    Stale samples (staleness > ``max_lag``) are dropped, or kept and corrected by
    ``policy_loss``'s decoupled rollout correction."""
    from rlvr_kernels.async_rollout import RolloutProducer, StalenessOptions, staleness_mask

    options = StalenessOptions(max_lag=lag if max_lag is None else max_lag, stale=stale)
    gen_model = make_model(cfg)

    def produce(batch_index, payload, version, latest):
        gen_model.load_state_dict(payload)  # the weights of ``version``, published by the trainer
        return generate(gen_model, cfg, gen)

    with RolloutProducer(produce, lag, initial_payload=_snapshot(model), timeout=300) as producer:
        for step in range(1, cfg.steps + 1):
            rollout = producer.get()
            ro = rollout.data
            vmin, vmax = rollout.stamps(batch_size=ro.rewards.shape[0])
            res = staleness_mask(vmin, vmax, step - 1, options)
            row = train_step(
                model, ref_model, opt, ro, cfg, reference=reference, shaping=shaping, keep=res.keep, correct=res.correct
            )
            row.update(
                version_min=int(vmin.min()), version_max=int(vmax.max()), update_version=step - 1, **res.stats.to_dict()
            )
            producer.publish(step, _snapshot(model))
            after_update(step, row)


def _last(history: List[Dict], key: str) -> float:
    return next((h[key] for h in reversed(history) if key in h), float("nan"))


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="GRPO", unit="step", file=sys.stderr, leave=False)


def _line(row: Dict) -> str:
    val = f"  val {row['val_success']:.3f}" if "val_success" in row else ""
    return (
        f"step {row['step']:4d}  reward {row['reward']:.3f}  len {row['length']:.2f}  "
        f"entropy {row['entropy']:.3f}  clipfrac {row['clipfrac']:.3f}  kl {row['kl']:.4f}  "
        f"kept {row['kept_groups']:2d}  loss {row['loss']:+.4f}{val}  ({row['time']:.0f} s)"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--reference", action="store_true", help="the pure-PyTorch reference ops")
    p.add_argument("--shaping", default="none", choices=sorted(SHAPINGS))
    p.add_argument("--kl", default=Config.kl, choices=KL_CHOICES, help="the KL to the warm-up model (Config.kl)")
    p.add_argument("--kl-coef", type=float, default=Config.kl_coef)
    p.add_argument("--async-lag", type=int, default=None, help="generate up to K versions ahead")
    p.add_argument("--stale", default="drop", choices=["drop", "correct"])
    p.add_argument("--max-lag", type=int, default=None, help="staleness bound (default: --async-lag)")
    p.add_argument("--out", default=os.path.join(HERE, "figures"), help="where the PNG and JSON go")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    cfg = dataclasses.replace(Config(), steps=args.steps, seed=args.seed, kl=args.kl, kl_coef=args.kl_coef)
    res = run(
        cfg,
        reference=args.reference,
        shaping=args.shaping,
        async_lag=args.async_lag,
        stale=args.stale,
        max_lag=args.max_lag,
        progress=not args.no_progress,
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "grpo_tiny" + ("" if args.async_lag is None else f"_async{args.async_lag}"))
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res, stem + ".png")
    print(f"curves: {stem}.png, history: {stem}.json")
    if args.async_lag is not None:
        plot_versions(res, stem + "_versions.png")
        print(f"version flow: {stem}_versions.png")
    return 0


def plot(res: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    warm, hist = res["warmup"], res["history"]
    w_end = warm[-1]["step"] if warm else 0
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    ax = axes[0, 0]
    ax.plot([w["step"] for w in warm], [w["val_success"] for w in warm], color="gray", label="warm-up (SFT)")
    vs = [h for h in hist if "val_success" in h]
    ax.plot([w_end + h["step"] for h in vs], [h["val_success"] for h in vs], color="C0", label="GRPO")
    ax.axvline(w_end, color="k", ls="--", lw=1)
    ax.text(w_end, 0.95, " warm-up ends", va="top", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title("validation success (greedy)")
    ax.set_xlabel("step (warm-up, then GRPO)")
    ax.legend(loc="lower right", fontsize=8)
    steps = [h["step"] for h in hist[1:]]
    for ax, key, title in zip(
        axes.flat[1:],
        ["reward", "length", "entropy", "clipfrac", "kept_groups"],
        [
            "train reward (sampled)",
            "response length",
            "entropy",
            "clip fraction",
            "kept groups (of %d)" % res["config"]["prompts"],
        ],
    ):
        ys = [h[key] for h in hist[1:]]
        ax.plot(steps, ys, lw=0.6, alpha=0.5)
        k = 10
        if len(ys) >= k:
            smooth = [sum(ys[i - k + 1 : i + 1]) / k for i in range(k - 1, len(ys))]
            ax.plot(steps[k - 1 :], smooth, lw=1.5, color="C0")
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
    fig.suptitle("GRPO on rlvr_kernels' fused ops: sorting %d digits, tiny Qwen2, CPU" % res["config"]["digits"])
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_versions(res: Dict, path: str) -> None:
    """Generation version against update version, per batch (min–max when a rollout spans
    an update), with the staleness bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = [h for h in res["history"] if "update_version" in h]
    u = [h["update_version"] for h in hist]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(u, u, color="k", lw=1, label="on-policy (version = update)")
    lag = res["async_lag"]
    ax.plot(u, [x - lag for x in u], color="r", lw=1, ls="--", label=f"bound: update − {lag}")
    ax.vlines(u, [h["version_min"] for h in hist], [h["version_max"] for h in hist], color="C0", lw=2)
    ax.scatter(u, [h["version_min"] for h in hist], s=6, color="C0", label="generation version of the batch")
    ax.set_xlabel("update version (the weights being trained)")
    ax.set_ylabel("generation version")
    ax.set_title(f"version flow, --async-lag {lag}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
