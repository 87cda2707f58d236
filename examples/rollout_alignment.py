"""Rollout alignment, shown: a trainer's LM head set as the engine's (bf16 logits, top-p) against
an emulated vLLM sampler, on a tiny transformer, with the mismatch measured.

The engine (emulated in PyTorch, vLLM v1's order: ``vllm/v1/sample/sampler.py``, ``Sampler.forward``
and ``Sampler.sample``; ``vllm/v1/sample/ops/topk_topp_sampler.py``, ``forward_native`` and
``apply_top_k_top_p``): the LM head in bf16 (``hidden.bfloat16() @ W.bfloat16().T``, a bf16 GEMM
with its bf16 output), the logits to fp32, divided by the temperature, top-p by vLLM's sort
(``rlvr_kernels.testing.sampling.vllm_kept``), a token drawn from the kept set's softmax by the
exponential race vLLM uses (``random_sample``), and its ``processed_logprobs`` (the log-softmax of
the filtered logits) reported. The rollout decodes autoregressively (KV cache) and keeps each
step's last hidden state, so the trainer below scores exactly the rows the engine sampled from.

The trainer: ``linear_logprobs`` on those hidden states and the same LM head, in four settings:
(a) fp32 logits, no top-p (what trainers do today), (b) ``logits_precision="bf16"`` only,
(c) ``top_p`` only, (d) both (matched), and (e) bf16 with the engine's kept set itself passed as
``support_ids`` (what an engine that exports its kept ids allows). ``rollout_mismatch`` measures
each against the engine's log-probs; a token the trainer finds outside its own kept set
(log-prob −inf, flagged in ``outside_support``) is counted and left out of the metrics (they
would be infinite).

The model: a tiny ``transformers`` Qwen2 built from a config (random init, no download) whose
LM head is scaled by one factor so the mean next-token entropy at the sampling temperature is
``--target-entropy`` nats (a random-init head gives near-uniform rows, log V nats): a
realistic peak, and logits of realistic magnitude for the bf16 rounding.

    python examples/rollout_alignment.py                      # ~30 s on 2 CPU cores
    python examples/rollout_alignment.py --backend reference  # the pure-PyTorch reference ops
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from typing import Dict, Optional

import torch

import rlvr_kernels as rk
from rlvr_kernels.testing.sampling import tie_closure, vllm_kept

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "figures" / "rollout_alignment.png"

# The trainer's settings: (label, logits_precision, support). support: None (the full
# softmax), "top_p" (the engine's filter recomputed from the trainer's own logits), or "ids"
# (the engine's kept set itself, passed as support_ids / support_offsets).
CASES = (
    ("(a) fp32", "fp32", None),
    ("(b) bf16", "bf16", None),
    ("(c) top-p", "fp32", "top_p"),
    ("(d) bf16 + top-p", "bf16", "top_p"),
    ("(e) bf16 + kept ids", "bf16", "ids"),
)
RATIO_BOUNDS = (1 / 1.1, 1.1)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 8192
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    batch: int = 16  # sequences
    prompt_len: int = 8  # random prompt tokens before the sampled response
    response_len: int = 64  # sampled tokens per sequence (the scored rows)
    temperature: float = 1.0
    top_p: float = 0.9
    target_entropy: float = 2.5  # nats: mean next-token entropy the LM-head scale is set for
    seed: int = 0
    backend: str = "auto"  # linear_logprobs / rollout_mismatch backend: auto | reference | cpu


# ----------------------------------------------------------------------------- the model
def make_model(cfg: Config):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=2 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.prompt_len + cfg.response_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(cfg.seed)
    return Qwen2ForCausalLM(config).float().eval()


def mean_entropy(z: torch.Tensor) -> float:
    logp = torch.log_softmax(z, dim=-1)
    return float(-(logp.exp() * logp).sum(-1).mean())


@torch.no_grad()
def calibrate_head(model, cfg: Config, gen: torch.Generator) -> float:
    """Scale the LM head so the mean entropy of softmax(hidden·Wᵀ / T) over a probe batch
    (random tokens, teacher-forced) is ``cfg.target_entropy``: bisection on log(scale), the
    entropy falling as the scale grows. Returns the factor applied."""
    ids = torch.randint(cfg.vocab, (cfg.batch, 16), generator=gen)
    h = model.model(input_ids=ids).last_hidden_state.reshape(-1, cfg.hidden)
    y = h @ model.lm_head.weight.T
    lo, hi = -4.0, 8.0  # log scale: e^-4 (near uniform) .. e^8 (near one-hot)
    for _ in range(24):  # to 12 / 2^24 in log(scale): far below the entropy's noise
        mid = (lo + hi) / 2
        if mean_entropy(y * (torch.exp(torch.tensor(mid)) / cfg.temperature)) > cfg.target_entropy:
            lo = mid
        else:
            hi = mid
    scale = float(torch.exp(torch.tensor((lo + hi) / 2)))
    model.lm_head.weight.mul_(scale)
    return scale


# ----------------------------------------------------------------------------- the engine
def engine_step(h: torch.Tensor, weight: torch.Tensor, cfg: Config, gen: torch.Generator):
    """One decode step of the emulated vLLM sampler on hidden rows h [B, H]: the sampled
    tokens, their processed and raw log-probs, and the kept set [B, V]."""
    # The model runs its LM head in bf16: a bf16 GEMM whose output is bf16; the sampler
    # then works in fp32 (Sampler.forward: logits.to(torch.float32)).
    raw = (h.bfloat16() @ weight.bfloat16().T).float()
    raw_logprobs = raw.log_softmax(-1)  # logprobs_mode="raw_logprobs": before temperature and filters
    z = raw / cfg.temperature  # Sampler.apply_temperature: logits.div_(temp)
    kept = vllm_kept(z, top_p=cfg.top_p)
    filtered = z.masked_fill(~kept, float("-inf"))
    processed = filtered.log_softmax(-1)  # logprobs_mode="processed_logprobs"
    probs = filtered.softmax(-1)
    q = torch.empty_like(probs).exponential_(generator=gen)  # random_sample: probs / Exp(1), argmax
    tokens = (probs / q).argmax(-1)
    pick = tokens[:, None]
    return tokens, processed.gather(1, pick)[:, 0], raw_logprobs.gather(1, pick)[:, 0], kept, z


@torch.no_grad()
def rollout(model, cfg: Config, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    """Random prompts, then ``response_len`` tokens decoded with the engine head; every
    step's last hidden state (after the final norm) is kept with what the engine reported."""
    weight = model.lm_head.weight
    ids = torch.randint(cfg.vocab, (cfg.batch, cfg.prompt_len), generator=gen)
    out = model.model(input_ids=ids, use_cache=True)
    rows = {k: [] for k in ("hidden", "tokens", "processed", "raw", "tie_split", "kept")}
    for _ in range(cfg.response_len):
        h = out.last_hidden_state[:, -1]
        tokens, processed, raw, kept, z = engine_step(h, weight, cfg, gen)
        rows["hidden"].append(h)
        rows["tokens"].append(tokens)
        rows["processed"].append(processed)
        rows["raw"].append(raw)
        # vLLM's sort splits a tie class of bf16 logits at the top-p boundary; a threshold
        # (the kernels' contract) keeps it whole: the rows where the two kept sets differ.
        rows["tie_split"].append((tie_closure(z, kept) != kept).any(-1))
        rows["kept"].append(kept)
        out = model.model(input_ids=tokens[:, None], past_key_values=out.past_key_values, use_cache=True)
    # [B, L] layout, row b * L + t: sequence b, response position t.
    return {k: torch.stack(v, 1).reshape(cfg.batch * cfg.response_len, *v[0].shape[1:]) for k, v in rows.items()}


# ----------------------------------------------------------------------------- the trainer
def trainer_logprobs(hidden, weight, tokens, cfg: Config, precision: str, support=None, kept=None):
    """``linear_logprobs`` of the sampled tokens in one of the trainer settings of CASES
    (``kept``: the engine's kept set [N, V], for support "ids")."""
    extra = {}
    if support == "top_p":
        extra = dict(top_p=cfg.top_p, sampling_convention="vllm")
    elif support == "ids":
        counts = kept.sum(-1)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        extra = dict(support_ids=kept.nonzero()[:, 1], support_offsets=offsets)
    return rk.linear_logprobs(
        hidden, weight, tokens, temperature=cfg.temperature, logits_precision=precision, backend=cfg.backend, **extra
    )


def compare(train: torch.Tensor, engine: torch.Tensor, outside: Optional[torch.Tensor], cfg: Config) -> Dict:
    """The mismatch metrics of trainer vs engine log-probs over the tokens the trainer
    scores finitely (``rollout_mismatch`` on [B, L])."""
    shape = (cfg.batch, cfg.response_len)
    valid = torch.ones(shape, dtype=torch.bool) if outside is None else ~outside.reshape(shape)
    safe = torch.where(valid.reshape(-1), train, engine)  # masked tokens are never read; keep them finite
    m = rk.rollout_mismatch(
        safe.reshape(shape), engine.reshape(shape), valid, ratio_bounds=RATIO_BOUNDS, backend=cfg.backend
    )
    delta = (train - engine)[valid.reshape(-1)].double()
    return {
        "tokens": int(m.num_tokens),
        "outside_support": 0 if outside is None else int(outside.sum()),
        "delta_mean": float(delta.mean()) if delta.numel() else 0.0,
        "delta_std": float(delta.std(correction=0)) if delta.numel() else 0.0,
        "abs_diff_max": float(m.abs_diff_max),
        "abs_diff_mean": float(m.abs_diff_mean),
        "k1": float(m.k1),
        "k3": float(m.k3),
        "ratio_frac_outside": float(m.ratio_frac_outside),
        "exact": int((delta == 0).sum()),
        "delta": delta.tolist(),
    }


def simulate(cfg: Config) -> Dict:
    """The model, its head scaled, and the engine's rollout (everything but the trainer)."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    model = make_model(cfg)
    scale = calibrate_head(model, cfg, gen)
    t_model = time.perf_counter() - t0
    ro = rollout(model, cfg, gen)
    ro.update(
        weight=model.lm_head.weight.detach(),
        lm_head_scale=scale,
        seconds_model=t_model,
        seconds_rollout=time.perf_counter() - t0 - t_model,
    )
    return ro


def measure(cfg: Config, ro: Dict, log=print) -> Dict:
    """Every trainer setting of CASES against the engine's log-probs of a rollout, on
    ``cfg.backend``; with the diagnostics that say where a residual comes from."""
    weight, hidden = ro["weight"], ro["hidden"]
    with torch.no_grad():
        z32 = hidden @ weight.T / cfg.temperature
        z16 = (hidden.bfloat16() @ weight.bfloat16().T).float() / cfg.temperature
        # The engine's bf16 GEMM against the same rule with an exact (fp64) sum: an fp32
        # accumulation order can move y across a bf16 rounding boundary.
        exact_bf16 = (hidden.bfloat16().double() @ weight.bfloat16().double().T).float().bfloat16().float()
        bf16_flips = int((exact_bf16 / cfg.temperature != z16).sum())
        # The engine's kept mass (its own logits): what (a) and (b) leave out of the normaliser.
        kept_mass = torch.where(ro["kept"], z16.softmax(-1), 0.0).sum(-1)
    res: Dict = {
        "config": dataclasses.asdict(cfg),
        "lm_head_scale": ro["lm_head_scale"],
        "entropy_fp32": mean_entropy(z32),
        "max_logit_mean": float(z16.amax(-1).mean()),  # the rows' largest logit, averaged
        "kept_size_mean": float(ro["kept"].sum(-1).double().mean()),
        "log_kept_mass_mean": float(kept_mass.log().mean()),
        "tie_split_rows": int(ro["tie_split"].sum()),
        "bf16_logit_flips": bf16_flips,
        "logits": hidden.shape[0] * cfg.vocab,
        "cases": [],
    }
    t1 = time.perf_counter()
    for label, precision, support in CASES:
        out = trainer_logprobs(hidden, weight, ro["tokens"], cfg, precision, support, ro["kept"])
        logp = out.logp.detach()
        row = compare(logp, ro["processed"], out.outside_support, cfg)
        row.update(label=label, logits_precision=precision, support=support)
        # Where the residual lives: the rows whose top-p boundary fell inside a bf16 tie
        # (vLLM keeps part of the tie, a threshold all of it) and the others.
        delta = (logp - ro["processed"]).double()
        fine = ~ro["tie_split"] & torch.isfinite(delta)
        row["max_abs_delta_unsplit_rows"] = float(delta[fine].abs().max()) if bool(fine.any()) else 0.0
        row["nonzero_unsplit_rows"] = int((delta[fine] != 0).sum())
        res["cases"].append(row)
    # vLLM's default logprobs_mode, "raw_logprobs", reports the log-softmax of the logits
    # before the temperature and the filters: the trainer setting it matches is (b) at T = 1.
    out = trainer_logprobs(hidden, weight, ro["tokens"], dataclasses.replace(cfg, temperature=1.0), "bf16")
    raw = compare(out.logp.detach(), ro["raw"], None, cfg)
    raw.update(label="raw_logprobs vs (b), T = 1", logits_precision="bf16", support=None)
    res["raw_mode"] = raw
    res["seconds"] = {
        "model": ro["seconds_model"],
        "rollout": ro["seconds_rollout"],
        "trainer": time.perf_counter() - t1,
    }
    log(
        f"model + head scale {ro['seconds_model']:.1f} s, rollout {ro['seconds_rollout']:.1f} s, trainer heads "
        f"{res['seconds']['trainer']:.1f} s ({cfg.backend} backend)"
    )
    return res


def experiment(cfg: Config, log=print) -> Dict:
    return measure(cfg, simulate(cfg), log=log)


# ----------------------------------------------------------------------------- report
def table(res: Dict) -> str:
    head = (
        "| trainer head | std Δ | max \\|Δ\\| | mean Δ | k1 | k3 | ρ outside [1/1.1, 1.1] | Δ = 0 exactly "
        "| outside support |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["cases"]:
        lines.append(
            f"| {r['label']} | {r['delta_std']:.2e} | {r['abs_diff_max']:.2e} | {r['delta_mean']:+.2e} "
            f"| {r['k1']:.2e} | {r['k3']:.2e} | {100 * r['ratio_frac_outside']:.1f}% "
            f"| {r['exact']} / {r['tokens']} | {r['outside_support']} |"
        )
    return "\n".join(lines)


def summary(res: Dict) -> str:
    c = res["config"]
    n = c["batch"] * c["response_len"]
    return (
        f"{c['batch']} sequences x {c['response_len']} sampled tokens = {n} rows, V = {c['vocab']}, H = {c['hidden']}, "
        f"T = {c['temperature']:g}, top-p = {c['top_p']:g}; LM head scaled x{res['lm_head_scale']:.2f}: "
        f"mean entropy {res['entropy_fp32']:.2f} nats, mean top logit {res['max_logit_mean']:.1f}, "
        f"mean kept set {res['kept_size_mean']:.1f} tokens, "
        f"mean log(kept mass) {res['log_kept_mass_mean']:+.2e}; "
        f"bf16 logits that differ from the fp64-accumulated rule: {res['bf16_logit_flips']} of {res['logits']}; "
        f"rows whose top-p boundary splits a bf16 tie: {res['tie_split_rows']} of {n}"
    )


def plot(res: Dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    cases = res["cases"]
    colors = ("tab:red", "tab:orange", "tab:blue", "tab:green", "tab:purple")
    labels = [r["label"] for r in cases]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))

    ax = axes[0]
    floor = 1e-9  # |Δ| = 0 drawn here: the curve's value at the left edge is the exact share
    for r, color in zip(cases, colors):
        d = sorted(max(abs(x), floor) for x in r["delta"]) or [floor]
        share = [(i + 1) / len(d) for i in range(len(d))]
        ax.step(
            [floor] + d,
            [sum(x == floor for x in d) / len(d)] + share,
            where="post",
            color=color,
            lw=1.3,
            label=f"{r['label']} (mean Δ {r['delta_mean']:+.1e})",
        )
    ax.set_xscale("log")
    ax.set_xlim(floor / 2, 1)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(f"|Δ|, Δ = trainer − engine log-prob (0 drawn at {floor:g})")
    ax.set_ylabel("share of tokens with |Δ| ≤ x")
    ax.set_title("per-token log-ratio (CDF)")
    ax.legend(fontsize=7, loc="center left")
    ax.grid(alpha=0.3)

    ax = axes[1]
    metrics = (("delta_std", "std Δ"), ("abs_diff_max", "max |Δ|"), ("k1", "|k1|"), ("k3", "k3"))
    width = 0.8 / len(cases)
    floor = 1e-9  # exact zeros drawn at the floor and labelled 0
    for j, (r, color) in enumerate(zip(cases, colors)):
        vals = [abs(r[k]) for k, _ in metrics]
        xs = [i + (j - (len(cases) - 1) / 2) * width for i in range(len(metrics))]
        ax.bar(xs, [max(v, floor) for v in vals], width, color=color, label=r["label"])
        for x, v in zip(xs, vals):
            ax.text(
                x,
                max(v, floor) * 1.3,
                "0" if v == 0 else f"{v:.0e}",
                ha="center",
                va="bottom",
                fontsize=5.5,
                rotation=90,
            )
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, 10)
    ax.set_xticks(range(len(metrics)), [name for _, name in metrics])
    ax.set_title("mismatch (rollout_mismatch)")
    ax.grid(alpha=0.3, axis="y")

    ax = axes[2]
    frac = [100 * r["ratio_frac_outside"] for r in cases]
    ax.bar(range(len(cases)), frac, color=colors)
    for i, (f, r) in enumerate(zip(frac, cases)):
        ax.text(i, f + 1, f"{f:.1f}%\n{r['outside_support']} outside\nsupport", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(cases)), [label.split(" ")[0] for label in labels])
    ax.set_ylim(0, max(frac + [1.0]) * 1.35 + 5)
    ax.set_ylabel("% of tokens")
    ax.set_title("ratio outside [1/1.1, 1.1]")
    ax.grid(alpha=0.3, axis="y")

    c = res["config"]
    fig.suptitle(
        f"trainer head vs emulated vLLM sampler (bf16 LM head, T = {c['temperature']:g}, top-p {c['top_p']:g}, "
        f"processed_logprobs); tiny Qwen2, {c['batch']}x{c['response_len']} tokens, V = {c['vocab']}, "
        f"entropy {res['entropy_fp32']:.1f} nats, {c['backend']} backend",
        fontsize=9,
    )
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


def _unit(text):
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="PNG path (its folder is created)")
    ap.add_argument("--json", type=pathlib.Path, default=None, help="also write the measured numbers here")
    ap.add_argument("--backend", default="auto", choices=("auto", "reference", "cpu"))
    ap.add_argument("--vocab", type=_positive(int), default=Config.vocab)
    ap.add_argument("--batch", type=_positive(int), default=Config.batch)
    ap.add_argument("--response-len", type=_positive(int), default=Config.response_len)
    ap.add_argument("--temperature", type=_positive(float), default=Config.temperature)
    ap.add_argument("--top-p", type=_unit, default=Config.top_p)
    ap.add_argument("--target-entropy", type=_positive(float), default=Config.target_entropy)
    ap.add_argument("--seed", type=int, default=Config.seed)
    args = ap.parse_args(argv)
    flags = ("vocab", "batch", "response_len", "temperature", "top_p", "target_entropy", "seed", "backend")
    cfg = Config(**{name: getattr(args, name) for name in flags})
    res = experiment(cfg)
    print(summary(res))
    print(table(res))
    r = res["raw_mode"]
    print(f"engine raw_logprobs vs trainer (b) at T = 1: std Δ {r['delta_std']:.2e}, max |Δ| {r['abs_diff_max']:.2e}")
    for r in res["cases"]:
        print(
            f"{r['label']}: on the rows without a split tie max |Δ| {r['max_abs_delta_unsplit_rows']:.2e}, "
            f"{r['nonzero_unsplit_rows']} tokens with Δ != 0"
        )
    plot(res, args.out)
    print(f"wrote {args.out}")
    if args.json is not None:
        slim = {k: v for k, v in res.items() if k not in ("cases", "raw_mode")}
        slim["cases"] = [{k: v for k, v in r.items() if k != "delta"} for r in res["cases"] + [res["raw_mode"]]]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(slim, indent=1))
    return 0


if __name__ == "__main__":
    main()
