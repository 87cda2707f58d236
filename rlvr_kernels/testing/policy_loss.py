"""``policy_loss``: random cases, the forward/backward runner, comparisons and the ``rlvr-kernels check`` suite."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ._checks import CheckRow, CheckSuite, check_row
from ._compare import Comparison, as_float64, compare

# Ratio values where the loss has a kink (clip bounds, dual clip, IS caps); random inputs
# are nudged away from them so that a last-ulp difference between fp32 and fp64 cannot
# flip a branch (a real, but measure-zero, disagreement the tolerance rule cannot absorb).
_KINK_GAP = 1e-3


def random_policy_case(
    gen: torch.Generator,
    *,
    B: int = 13,
    L: int = 29,
    layout: str = "padded",
    dtype: torch.dtype = torch.float32,
    token_adv: bool = False,
    spread: float = 0.3,
    masked_rows: int = 1,
    kinks=(0.8, 1.2, 1.28, 3.0, 2.0, 0.5),
    device: str = "cpu",
) -> Dict:
    """Fresh random inputs for ``policy_loss``: ragged lengths (``masked_rows`` sequences
    with no valid token), log-probs around −1 with log-ratios of std ``spread`` (clipping
    active on both sides), advantages of both signs and some exact zeros, entropies in
    [0, 3]. ``layout``: ``"padded"`` ([B, L] + bool mask) or ``"packed"`` ([T] +
    cu_seqlens, with a mask dropping some tokens)."""
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    if masked_rows and B:
        lengths[torch.randperm(B, generator=gen)[: min(masked_rows, B)]] = 0
    n = (B, L) if layout == "padded" else (int(lengths.sum()),)
    logp = (-torch.rand(n, generator=gen, dtype=torch.float64) * 3).to(dtype).double()
    old = (logp + spread * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype).double()
    # Push log-ratios away from the kinks (both δ = logp − old and old − rollout use them).
    for k in kinks:
        near = ((logp - old).exp() / k - 1).abs() < _KINK_GAP
        old = torch.where(near, old + 5 * _KINK_GAP, old).to(dtype).double()
    ref = (logp + spread * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype).double()
    roll = (old + spread * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype).double()
    for k in kinks:
        near = ((old - roll).exp() / k - 1).abs() < _KINK_GAP
        roll = torch.where(near, roll - 5 * _KINK_GAP, roll).to(dtype).double()
    entropy = (torch.rand(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    if token_adv:
        adv = torch.randn(n, generator=gen)
    else:
        adv = torch.randn(B, generator=gen)
        adv[torch.rand(B, generator=gen) < 0.15] = 0.0
    kw = dict(
        logprobs=logp.to(dtype),
        old_logprobs=old.to(dtype),
        advantages=adv,
        ref_logprobs=ref.to(dtype),
        rollout_logprobs=roll.to(dtype),
        entropy=entropy,
    )
    if layout == "padded":
        kw["mask"] = torch.arange(L)[None, :] < lengths[:, None]
    else:
        cu = torch.zeros(B + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        kw["cu_seqlens"] = cu
        kw["mask"] = torch.rand(n, generator=gen) > 0.1
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _call_kwargs(options: Dict) -> Dict:
    """``options`` as ``policy_loss`` keywords; with a field that has no keyword there
    (``dro_beta``), the resolved :class:`PolicyLossOptions` as ``options=`` plus the
    aggregation arguments."""
    import inspect

    from .. import policy_loss
    from ..options import resolve_policy_loss_options

    if set(options) <= set(inspect.signature(policy_loss).parameters):
        return options
    agg = {k: v for k, v in options.items() if k in _AGG_KWARGS}
    fields = {k: v for k, v in options.items() if k not in _AGG_KWARGS + ("preset",)}
    return dict(agg, options=resolve_policy_loss_options(options.get("preset"), **fields))


def run_policy_loss(
    inputs: Dict, options: Dict, backend: str, upstream: Optional[torch.Tensor] = None, entropy_grad: bool = True
) -> Dict[str, torch.Tensor]:
    """Forward + backward of ``policy_loss`` on fresh leaves; returns the loss, every
    metric and the gradients of ``logprobs`` (and of ``entropy`` when it is used)."""
    from .. import policy_loss

    kw = dict(inputs)
    lp = kw["logprobs"].detach().clone().requires_grad_(True)
    kw["logprobs"] = lp
    ent = kw.get("entropy")
    if ent is not None:
        ent = ent.detach().clone().requires_grad_(entropy_grad)
        kw["entropy"] = ent
    loss, metrics = policy_loss(**kw, **_call_kwargs(options), backend=backend)
    if upstream is None:
        upstream = torch.ones_like(loss) if loss.dim() == 0 else None
    (loss * upstream.to(loss.dtype)).sum().backward() if upstream is not None else loss.sum().backward()
    out = {"loss": loss.detach()}
    out.update({f"metric.{k}": v for k, v in metrics._asdict().items()})
    out["grad.logprobs"] = lp.grad if lp.grad is not None else torch.zeros_like(lp)
    if ent is not None and entropy_grad:
        out["grad.entropy"] = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return out


def compare_policy(
    fast: Dict,
    ref64: Dict,
    same: Dict,
    out_dtype: torch.dtype = torch.float32,
    reductions: Optional[Dict[str, Tuple[float, int]]] = None,
) -> List[Comparison]:
    """The tolerance rule on every output of :func:`run_policy_loss`. Gradients are
    compared in the inputs' dtype scale; ``out_dtype`` is the dtype of the gradients.
    ``reductions`` (from :func:`reduction_magnitudes`) gives the reduced outputs their
    summation-order allowance."""
    reductions = reductions or {}
    comps = []
    for key, r in ref64.items():
        dt = out_dtype if key.startswith("grad.") else torch.float32
        comps.append(compare(key, fast[key], r, same[key], dt, reduction=reductions.get(key)))
    return comps


_AGG_KWARGS = ("global_num_tokens", "global_num_seqs", "dp_size", "loss_scale_factor")


def reduction_magnitudes(inputs: Dict, options: Dict) -> Dict[str, Tuple[float, int]]:
    """(S, n) for each output of :func:`run_policy_loss` that sums per-token terms: n the
    valid tokens, S the output's own aggregation taken over the terms' absolute values
    (the loss and ``pg_loss``/``kl_loss`` through ``agg``; ``ppo_kl``, ``kl`` as token
    means). The per-token terms come from the fp64 reference with ``agg="none"``: the loss
    itself, then with ``kl_coef = entropy_coef = 0`` (the policy-gradient term alone),
    then with ``entropy_coef = 0`` (adds β·KL)."""
    from .. import policy_loss
    from ..options import resolve_policy_loss_options

    ref = importlib.import_module(
        "rlvr_kernels.reference.policy_loss"
    )  # the package re-exports a function of that name

    x = as_float64(inputs)
    given = options.get("options")  # a PolicyLossOptions (the options no keyword reaches)
    option_kw = {k: v for k, v in options.items() if k not in _AGG_KWARGS + ("preset", "options")}
    opts = given if given is not None else resolve_policy_loss_options(options.get("preset"), **option_kw)

    def per_token(**override):
        if given is not None:
            kw = dict(options, options=dataclasses.replace(given, agg="none", **override))
        else:
            kw = _call_kwargs(dict(options, agg="none", **override))
        loss, _ = policy_loss(**x, **kw, backend="reference")
        return ref.to_padded(loss.detach(), x.get("cu_seqlens"))

    valid = ref._valid_padded(x["logprobs"], x.get("mask"), x.get("cu_seqlens"))
    m = valid.double()
    n = int(valid.sum())
    agg_kw = {k: options[k] for k in _AGG_KWARGS if options.get(k) is not None}
    agg_kw.setdefault("dp_size", 1)

    def aggregated(t):
        return float(ref.aggregate(opts, t.abs(), m, **agg_kw).sum())

    def token_mean(t):
        return float((t.abs() * m).sum()) / max(n, 1)

    loss = per_token()
    pg = per_token(kl_coef=0.0, entropy_coef=0.0)
    kl = (per_token(entropy_coef=0.0) - pg) / opts.kl_coef if opts.kl is not None and opts.kl_coef else 0 * pg
    delta = ref.to_padded(x["logprobs"], x.get("cu_seqlens")) - ref.to_padded(x["old_logprobs"], x.get("cu_seqlens"))
    out = {
        "metric.pg_loss": (aggregated(pg), n),
        "metric.kl_loss": (aggregated(kl), n),
        "metric.ppo_kl": (token_mean(delta), n),
        "metric.kl": (token_mean(kl), n),
    }
    if opts.agg != "none":
        out["loss"] = (aggregated(loss), n)
    return out


def upstream_for(inputs: Dict, options: Dict, gen: torch.Generator) -> Optional[torch.Tensor]:
    """A random per-token upstream gradient for ``agg="none"`` (else the scalar 1)."""
    if options.get("agg") != "none":
        return None
    return torch.randn(inputs["logprobs"].shape, generator=gen).to(inputs["logprobs"].device)


def assert_matches_reference(
    inputs: Dict, options: Dict, backend: str, gen: torch.Generator, entropy_grad: bool = True
) -> Dict[str, torch.Tensor]:
    """``backend`` against the fp64 reference on ``inputs`` (loss, metrics, gradients, the
    same random upstream gradient): asserts the tolerance rule on every output, with the
    reductions' summation-order allowance, and the gradient's dtype; returns its outputs."""
    up = upstream_for(inputs, options, gen)
    ref64 = run_policy_loss(as_float64(inputs), options, "reference", up, entropy_grad)
    same = run_policy_loss(inputs, options, "reference", up, entropy_grad)
    fast = run_policy_loss(inputs, options, backend, up, entropy_grad)
    sums = reduction_magnitudes(inputs, options)
    bad = [c for c in compare_policy(fast, ref64, same, inputs["logprobs"].dtype, sums) if not c.ok]
    assert not bad, bad
    assert fast["grad.logprobs"].dtype == inputs["logprobs"].dtype
    return fast


def check_cases() -> List[tuple]:
    from ..options import TokenShaping

    a3 = TokenShaping(probability=0.5, a3po_pos_low=(0.2, 1.5), a3po_neg_high=(0.2, 0.5))
    cases = [
        (
            "ppo verl dual clip + k3 + token_tis",
            {},
            dict(preset="verl", clip_high=0.28, kl="k3", kl_coef=0.1, rollout_correction="token_tis"),
        ),
        (
            "ppo trl k3 (no clamps), seq-mean-token-mean",
            {},
            dict(preset="trl", kl="k3", kl_coef=0.04, agg="seq-mean-token-mean"),
        ),
        ("gspo seq-mean-token-mean", {}, dict(loss_type="gspo", agg="seq-mean-token-mean")),
        ("cispo k3+ token-sum", {}, dict(loss_type="cispo", clip_high=4.0, kl="k3+", kl_coef=0.1, agg="token-sum")),
        ("sapo seq_tis", {}, dict(loss_type="sapo", rollout_correction="seq_tis", agg="seq-mean-token-mean")),
        ("reinforce k2 + entropy bonus", {}, dict(loss_type="reinforce", kl="k2", kl_coef=0.2, entropy_coef=0.01)),
        (
            "dppo_tv cap + token_tis",
            {},
            dict(loss_type="dppo_tv", clip_low=0.05, clip_high=0.1, clip_ratio_c=1.2, rollout_correction="token_tis"),
        ),
        (
            "dppo_kl cap + k3, seq-mean-token-mean",
            dict(token_adv=True),
            dict(
                loss_type="dppo_kl",
                clip_low=0.01,
                clip_high=0.02,
                clip_ratio_c=1.28,
                kl="k3",
                kl_coef=0.1,
                agg="seq-mean-token-mean",
            ),
        ),
        (
            "geo_mean seq_tis + k3, seq-mean-token-sum",
            dict(token_adv=True),
            dict(
                loss_type="geo_mean",
                clip_low=0.1,
                clip_high=0.2,
                rollout_correction="seq_tis",
                kl="k3",
                kl_coef=0.1,
                agg="seq-mean-token-sum",
            ),
        ),
        (
            "dro token_tis + polarity shaping",
            {},
            dict(loss_type="dro", dro_beta=0.3, rollout_correction="token_tis", shaping=TokenShaping(w_neg=0.5)),
        ),
        (
            "ppo token_mis + polarity + probability shaping",
            {},
            dict(
                rollout_correction="token_mis",
                shaping=TokenShaping(w_pos=0.1, probability=1.0),
                agg="seq-mean-token-sum",
            ),
        ),
        (
            "ppo seq_mis + a3po entropy + 80/20 quantile",
            {},
            dict(
                rollout_correction="seq_mis",
                agg="seq-mean-token-sum-norm",
                shaping=TokenShaping(a3po_metric="entropy", a3po_pos_high=(0.3, 2.0), entropy_quantile=0.2),
            ),
        ),
        ("ppo decoupled + a3po prob, agg none", {}, dict(rollout_correction="decoupled", shaping=a3, agg="none")),
        ("ppo token advantages, k1", dict(token_adv=True), dict(kl="k1", kl_coef=0.1)),
        ("ppo bf16 verl", dict(dtype=torch.bfloat16), dict(preset="verl", kl="k3", kl_coef=0.1)),
        # The peers' presets: the KL clamp scopes and kl_score_grad (docs/presets.md).
        ("ppo openrlhf k1 (clamped)", {}, dict(preset="openrlhf", kl="k1", kl_coef=0.1)),
        ("gspo slime low_var_kl", {}, dict(preset="slime", loss_type="gspo", kl="k3", kl_coef=0.1)),
        ("ppo areal k2 (clamped)", dict(token_adv=True), dict(preset="areal", kl="k2", kl_coef=0.1)),
        ("ppo nemo_rl k3 + score gradient", {}, dict(preset="nemo_rl", kl="k3", kl_coef=0.1)),
        ("ppo nemo_rl k3+ + score gradient", {}, dict(preset="nemo_rl", kl="k3+", kl_coef=0.1)),
        ("ppo skyrl k3", {}, dict(preset="skyrl", kl="k3", kl_coef=0.001)),
        ("prime_rl dppo_tv + k2", {}, dict(preset="prime_rl")),
    ]
    out = []
    for name, case_kw, opts in cases:
        for layout in ("padded", "packed"):
            if layout == "packed" and opts.get("agg") == "seq-mean-token-sum-norm":
                opts = dict(opts, loss_scale_factor=64.0)
            out.append((f"{name} {layout}", dict(case_kw, layout=layout), opts))
    return out


def check_policy_loss(
    backends: List[str], device: str = "cpu", seed: int = 0, progress: Optional[Callable] = None
) -> List[CheckRow]:
    """Every backend on fresh random inputs (loss, metrics, gradients), diffed against
    the fp64 reference."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, case_kw, opts in check_cases():
        inputs = random_policy_case(gen, B=37, L=61, device=device, **case_kw)
        up = upstream_for(inputs, opts, gen)
        ref64 = run_policy_loss(as_float64(inputs), opts, "reference", up)
        same = run_policy_loss(inputs, opts, "reference", up)
        for backend in backends:
            rows.append(
                check_row(
                    "policy_loss",
                    backend,
                    name,
                    lambda: compare_policy(
                        run_policy_loss(inputs, opts, backend, up),
                        ref64,
                        same,
                        inputs["logprobs"].dtype,
                        reduction_magnitudes(inputs, opts),
                    ),
                )
            )
            if progress:
                progress()
    return rows


SUITE = CheckSuite("policy_loss", check_cases, check_policy_loss)
