"""Correctness harness shared by the test suite and ``rlvr-kernels check``.

The rule (flash-attention's, SPEC "Standards"): a fast result passes when
    |fast − ref64| ≤ 2·|torch_same_dtype − ref64| + atol
elementwise, where ref64 is the reference on float64 copies of the inputs and
torch_same_dtype the reference run in the inputs' own dtype. ``atol`` covers the last
few ulps of the output dtype at the result's magnitude, which the reference may happen
to round exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import torch

from .options import GroupAdvantages

_ULPS = 8


def default_atol(ref64: torch.Tensor, out_dtype: torch.dtype) -> float:
    """A few ulps at the result's magnitude, of the output dtype or of fp32 (the
    accumulation precision SPEC §0 promises), whichever is coarser."""
    scale = max(1.0, float(ref64.abs().max())) if ref64.numel() else 1.0
    eps = max(torch.finfo(out_dtype).eps, torch.finfo(torch.float32).eps)
    return _ULPS * eps * scale


@dataclasses.dataclass
class Comparison:
    field: str
    max_abs: float
    max_rel: float
    ok: bool


def compare(field: str, fast, ref64, same, out_dtype: torch.dtype, atol_scale: float = 1.0) -> Comparison:
    """Tolerance rule for floating outputs; exact equality for integer and bool outputs.
    ``atol_scale`` widens atol for results derived from larger intermediates."""
    if fast is None or ref64 is None:
        ok = fast is None and ref64 is None
        return Comparison(field, 0.0, 0.0, ok)
    if tuple(fast.shape) != tuple(ref64.shape):
        return Comparison(field, float("inf"), float("inf"), False)
    if not ref64.is_floating_point():
        ok = bool(torch.equal(fast.cpu(), ref64.cpu()))
        return Comparison(field, 0.0 if ok else 1.0, 0.0 if ok else 1.0, ok)
    f, r, s = fast.double().cpu(), ref64.double().cpu(), same.double().cpu()
    if f.numel() == 0:
        return Comparison(field, 0.0, 0.0, True)
    err = (f - r).abs()
    bound = 2 * (s - r).abs() + default_atol(r, out_dtype) * atol_scale
    ok = bool(torch.isfinite(f).all()) and bool((err <= bound).all())
    rel = float(err.max()) / max(float(r.abs().max()), 1e-30)  # relative to the result's scale
    return Comparison(field, float(err.max()), rel, ok)


def compare_advantages(
    fast: GroupAdvantages, ref64: GroupAdvantages, same: GroupAdvantages, out_dtype: torch.dtype
) -> List[Comparison]:
    return [
        compare(name, getattr(fast, name), getattr(ref64, name), getattr(same, name), out_dtype)
        for name in GroupAdvantages._fields
    ]


def as_float64(kwargs: Dict) -> Dict:
    """A copy of op arguments with every floating tensor cast to float64."""
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}


def random_advantage_case(
    gen: torch.Generator,
    *,
    B: int,
    num_groups: int,
    layout: str = "none",
    L: int = 16,
    reward: str = "binary",
    dtype: torch.dtype = torch.float32,
    mask_fraction: float = 0.0,
    device: str = "cpu",
) -> Dict:
    """Fresh random inputs for ``group_advantages``: shuffled group ids (uneven sizes,
    some groups possibly empty), rewards of the named kind, an optional sample mask and a
    padded (``"padded"``) or packed (``"packed"``) token layout with ragged lengths."""
    group_index = (
        torch.randint(0, max(num_groups, 1), (B,), generator=gen) if num_groups else torch.zeros(B, dtype=torch.long)
    )
    if reward == "binary":
        scores = torch.randint(0, 2, (B,), generator=gen).to(torch.float32)
    elif reward == "int":
        scores = torch.randint(-2, 3, (B,), generator=gen).to(torch.float32)
    else:
        scores = torch.randn(B, generator=gen)
    kwargs = dict(scores=scores.to(dtype), group_index=group_index, num_groups=num_groups)
    if mask_fraction > 0:
        kwargs["sample_mask"] = torch.rand(B, generator=gen) >= mask_fraction
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    if layout == "padded":
        kwargs["response_mask"] = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float32)
    elif layout == "packed":
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        kwargs["cu_seqlens"] = cu
        kwargs["response_mask"] = torch.rand(int(cu[-1]), generator=gen) > 0.1
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


@dataclasses.dataclass
class CheckRow:
    op: str
    backend: str
    case: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""


def _check_row(op: str, backend: str, case: str, compute: Callable[[], List[Comparison]]) -> CheckRow:
    """One ``rlvr-kernels check`` row: the worst of the comparisons ``compute`` returns; a
    crash is a failed check, reported, not raised."""
    try:
        comps = compute()
    except Exception as e:
        return CheckRow(op, backend, case, float("nan"), float("nan"), False, repr(e)[:80])
    bad = [c.field for c in comps if not c.ok]
    worst = max(comps, key=lambda c: (not c.ok, c.max_abs))
    return CheckRow(
        op,
        backend,
        case,
        max(c.max_abs for c in comps),
        max(c.max_rel for c in comps),
        not bad,
        ", ".join(bad) or worst.field,
    )


# (name, inputs, options): the cases `rlvr-kernels check` runs on every backend.
def _check_cases() -> List[tuple]:
    cases = []
    for est, extra in [
        ("grpo", {}),
        ("grpo", dict(preset="verl")),
        ("grpo", dict(preset="trl", scale="batch")),
        ("grpo", dict(eps_in_sqrt=True, std="population")),
        ("dr_grpo", {}),
        ("rloo", dict(preset="verl")),
        ("opo", {}),
        ("gpg", {}),
        ("passk", dict(k=4)),
        ("reinforce_pp_baseline", dict(preset="verl")),
        ("gdpo", dict(preset="verl")),
        ("gdpo", dict(preset="trl")),
    ]:
        for layout in ("padded", "packed"):
            cases.append(
                (f"{est} {extra or ''} {layout}".replace("  ", " "), dict(layout=layout), dict(estimator=est, **extra))
            )
    cases.append(
        (
            "grpo bf16 scores, 30% masked",
            dict(layout="padded", dtype=torch.bfloat16, mask_fraction=0.3),
            dict(estimator="grpo"),
        )
    )
    cases.append(
        ("grpo group-only B=4097", dict(layout="none", B=4097, num_groups=300, reward="normal"), dict(estimator="grpo"))
    )
    return cases


def check_group_advantages(
    backends: List[str], device: str = "cpu", seed: int = 0, progress: Optional[Callable] = None
) -> List[CheckRow]:
    """Every backend on fresh random inputs, diffed against the fp64 reference."""
    from . import group_advantages

    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, case_kw, opts in _check_cases():
        base = dict(B=211, num_groups=23, L=37, reward="int")
        base.update(case_kw)
        inputs = random_advantage_case(gen, device=device, **base)
        ref64 = group_advantages(**as_float64(inputs), **opts, backend="reference", out_dtype=torch.float64)
        same = group_advantages(**inputs, **opts, backend="reference", out_dtype=inputs["scores"].dtype)
        for backend in backends:
            rows.append(
                _check_row(
                    "group_advantages",
                    backend,
                    name,
                    lambda: compare_advantages(
                        group_advantages(**inputs, **opts, backend=backend), ref64, same, torch.float32
                    ),
                )
            )
            if progress:
                progress()
    return rows


def check_case_count() -> int:
    return len(_check_cases())


# ---------------------------------------------------------------------------------------
# policy_loss

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


def run_policy_loss(
    inputs: Dict, options: Dict, backend: str, upstream: Optional[torch.Tensor] = None, entropy_grad: bool = True
) -> Dict[str, torch.Tensor]:
    """Forward + backward of ``policy_loss`` on fresh leaves; returns the loss, every
    metric and the gradients of ``logprobs`` (and of ``entropy`` when it is used)."""
    from . import policy_loss

    kw = dict(inputs)
    lp = kw["logprobs"].detach().clone().requires_grad_(True)
    kw["logprobs"] = lp
    ent = kw.get("entropy")
    if ent is not None:
        ent = ent.detach().clone().requires_grad_(entropy_grad)
        kw["entropy"] = ent
    loss, metrics = policy_loss(**kw, **options, backend=backend)
    if upstream is None:
        upstream = torch.ones_like(loss) if loss.dim() == 0 else None
    (loss * upstream.to(loss.dtype)).sum().backward() if upstream is not None else loss.sum().backward()
    out = {"loss": loss.detach()}
    out.update({f"metric.{k}": v for k, v in metrics._asdict().items()})
    out["grad.logprobs"] = lp.grad if lp.grad is not None else torch.zeros_like(lp)
    if ent is not None and entropy_grad:
        out["grad.entropy"] = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return out


def compare_policy(fast: Dict, ref64: Dict, same: Dict, out_dtype: torch.dtype = torch.float32) -> List[Comparison]:
    """The tolerance rule on every output of :func:`run_policy_loss`. Gradients are
    compared in the inputs' dtype scale; ``out_dtype`` is the dtype of the gradients."""
    comps = []
    for key, r in ref64.items():
        dt = out_dtype if key.startswith("grad.") else torch.float32
        comps.append(compare(key, fast[key], r, same[key], dt))
    return comps


def upstream_for(inputs: Dict, options: Dict, gen: torch.Generator) -> Optional[torch.Tensor]:
    """A random per-token upstream gradient for ``agg="none"`` (else the scalar 1)."""
    if options.get("agg") != "none":
        return None
    return torch.randn(inputs["logprobs"].shape, generator=gen).to(inputs["logprobs"].device)


def _policy_check_cases() -> List[tuple]:
    from .options import TokenShaping

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
    for name, case_kw, opts in _policy_check_cases():
        inputs = random_policy_case(gen, B=37, L=61, device=device, **case_kw)
        up = upstream_for(inputs, opts, gen)
        ref64 = run_policy_loss(as_float64(inputs), opts, "reference", up)
        same = run_policy_loss(inputs, opts, "reference", up)
        for backend in backends:
            rows.append(
                _check_row(
                    "policy_loss",
                    backend,
                    name,
                    lambda: compare_policy(
                        run_policy_loss(inputs, opts, backend, up), ref64, same, inputs["logprobs"].dtype
                    ),
                )
            )
            if progress:
                progress()
    return rows


def policy_check_case_count() -> int:
    return len(_policy_check_cases())


# ---------------------------------------------------------------------------------------
# linear_logprobs / logprobs_from_logits

ROW_KINDS = ("normal", "peaked", "flat", "negative")


def random_logprobs_case(
    gen: torch.Generator,
    *,
    N: int = 37,
    H: int = 33,
    V: int = 131,
    dtype: torch.dtype = torch.float32,
    rows: str = "normal",
    temperature="float",
    bias: bool = False,
    ignore_fraction: float = 0.0,
    branching: bool = False,
    device: str = "cpu",
) -> Dict:
    """Fresh random ``linear_logprobs`` arguments (``return_entropy=True``).

    ``rows``: ``"normal"`` (logits of std ~3), ``"peaked"`` (every row's target beats the
    rest by a margin of 45, before the temperature), ``"flat"`` (hidden = 0: uniform rows) or ``"negative"`` (every
    logit < 0). ``temperature``: ``"float"`` (0.7), ``"rows"`` (a per-row tensor in
    [0.5, 1.5]) or ``None`` (1.0). ``branching``: targets predicted through a
    ``row_index`` with repeats and rows that predict nothing (prefix-tree branch points)."""
    w = torch.randn(V, H, generator=gen, dtype=torch.float64) / H**0.5
    h = 3.0 * torch.randn(N, H, generator=gen, dtype=torch.float64)
    M = N + N // 2 if branching else N
    row_index = None
    if branching and N:
        row_index = torch.randint(0, max(1, N - 2), (M,), generator=gen)  # the last two rows predict nothing
    elif branching:
        M = 0
        row_index = torch.zeros(0, dtype=torch.int64)
    targets = torch.randint(0, V, (M,), generator=gen)
    if rows == "peaked" and N:
        # Row n is a multiple of one vocabulary row w_t, picked among 8 candidates for the
        # largest gap w_t·w_t − max_{u≠t} w_u·w_t and scaled so the margin is exactly 45.
        cand = torch.randint(0, V, (N, 8), generator=gen)
        zc = torch.einsum("nkh,vh->nkv", w[cand], w)
        own = zc.gather(-1, cand[..., None]).squeeze(-1)
        gap = own - zc.scatter(-1, cand[..., None], float("-inf")).amax(-1)
        best = gap.argmax(-1, keepdim=True)
        top, gap = cand.gather(-1, best).squeeze(-1), gap.gather(-1, best).squeeze(-1)
        if V > 1 and not bool((gap > 0).all()):
            raise ValueError("random_logprobs_case: no peaked direction found; use a larger H")
        h = (45.0 / gap.clamp(min=1e-3))[:, None] * w[top]
        rows_of = torch.arange(M) if row_index is None else row_index
        targets = top[rows_of]
    elif rows == "flat":
        h = torch.zeros(N, H, dtype=torch.float64)
    elif rows == "negative":
        w = w.abs()
        h = -h.abs()
    if ignore_fraction and M:
        targets[torch.rand(M, generator=gen) < ignore_fraction] = -100
    kw = dict(hidden=h.to(dtype), weight=w.to(dtype), targets=targets, row_index=row_index, return_entropy=True)
    if bias:
        kw["bias"] = (0.5 * torch.randn(V, generator=gen, dtype=torch.float64)).to(dtype)
        if rows == "negative":
            kw["bias"] = -kw["bias"].abs()
    if temperature == "float":
        kw["temperature"] = 0.7
    elif temperature == "rows":
        kw["temperature"] = (0.5 + torch.rand(N, generator=gen, dtype=torch.float64)).float()
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def logits_case_from(inputs: Dict) -> Dict:
    """``logprobs_from_logits`` arguments with the same logits as a linear case (no
    row_index), laid out ``[2, N/2, V]`` when N is even to exercise leading dimensions."""
    h, w = inputs["hidden"], inputs["weight"]
    logits = (h.double() @ w.double().T + (0 if inputs.get("bias") is None else inputs["bias"].double())).to(h.dtype)
    targets = inputs["targets"]
    temp = inputs.get("temperature", 1.0)
    if logits.shape[0] % 2 == 0 and logits.shape[0]:
        logits = logits.reshape(2, -1, logits.shape[-1])
        targets = targets.reshape(2, -1)
        if isinstance(temp, torch.Tensor):
            temp = temp.reshape(2, -1)
    return dict(logits=logits, targets=targets, temperature=temp, return_entropy=True)


def logprobs_upstream(inputs: Dict, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    """Random per-token upstream gradients for the log-probs and the entropies."""
    if "logits" in inputs:
        shape_lp = shape_ent = tuple(inputs["targets"].shape)
    else:
        shape_lp, shape_ent = tuple(inputs["targets"].shape), (inputs["hidden"].shape[0],)
    return {
        "logp": torch.randn(shape_lp, generator=gen, dtype=torch.float64),
        "entropy": torch.randn(shape_ent, generator=gen, dtype=torch.float64),
    }


def run_logprobs(inputs: Dict, backend: str, upstream: Optional[Dict] = None) -> Dict[str, torch.Tensor]:
    """Forward + backward of ``linear_logprobs`` (or ``logprobs_from_logits`` when the
    inputs hold ``logits``) on fresh leaves; returns the outputs and every gradient."""
    from . import linear_logprobs, logprobs_from_logits

    kw = dict(inputs)
    names = ["logits"] if "logits" in kw else ["hidden", "weight"] + (["bias"] if kw.get("bias") is not None else [])
    leaves = {n: kw[n].detach().clone().requires_grad_(True) for n in names}
    kw.update(leaves)
    fn = logprobs_from_logits if "logits" in kw else linear_logprobs
    logp, entropy = fn(**kw, backend=backend)
    out = {"logp": logp.detach(), "entropy": entropy.detach()}
    if upstream is not None:
        loss = (logp * upstream["logp"].to(logp)).sum() + (entropy * upstream["entropy"].to(entropy)).sum()
        if loss.requires_grad:
            loss.backward()
        for n, leaf in leaves.items():
            out[f"grad.{n}"] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return out


def logit_scale(inputs: Dict) -> float:
    """max |z| of a case (temperature-scaled logits, computed in fp64; small cases only)."""
    if "logits" in inputs:
        z = inputs["logits"].double()
    else:
        z = inputs["hidden"].double() @ inputs["weight"].double().T
        if inputs.get("bias") is not None:
            z = z + inputs["bias"].double()
    t = inputs.get("temperature", 1.0)
    z = z / (t.double()[..., None] if isinstance(t, torch.Tensor) else t)
    return float(z.abs().max()) if z.numel() else 0.0


def compare_logprobs(
    fast: Dict, ref64: Dict, same: Dict, in_dtype: torch.dtype, scale: float = 1.0
) -> List[Comparison]:
    """The tolerance rule on every output of :func:`run_logprobs`; gradients are in the
    inputs' dtype, log-probs and entropies fp32 (fp64 for fp64 inputs). Every output is a
    difference of O(|z|) quantities (z_t − lse, the entropy, p·(log p + H)), each carrying
    an absolute error of a few ulps of |z|: ``scale`` = max |z| (:func:`logit_scale`)
    widens atol by that factor (the 2·|same − ref64| term stays as it is)."""
    atol_scale = max(1.0, scale)
    return [
        compare(k, fast[k], r, same[k], in_dtype if k.startswith("grad.") else torch.float32, atol_scale)
        for k, r in ref64.items()
    ]


def _logprobs_check_cases() -> List[tuple]:
    """(name, random_logprobs_case kwargs, via logits?): small enough for the Triton interpreter."""
    base = [
        ("normal fp32, T=0.7", dict()),
        ("peaked rows (margin > 30), bias", dict(rows="peaked", bias=True)),
        ("flat rows", dict(rows="flat", temperature=None)),
        ("all-negative logits, bias", dict(rows="negative", bias=True)),
        ("per-row temperature, 20% ignored", dict(temperature="rows", ignore_fraction=0.2)),
        ("row_index with repeats (tree branch points)", dict(branching=True, ignore_fraction=0.1)),
        ("bf16, bias", dict(dtype=torch.bfloat16, bias=True)),
        ("V = 1031 (not a tile multiple)", dict(V=1031, N=19)),
    ]
    cases = [(f"linear: {n}", kw, False) for n, kw in base]
    cases += [(f"logits: {base[i][0]}", base[i][1], True) for i in (0, 1, 4, 6)]
    return cases


def check_logprobs(
    backends: List[str], device: str = "cpu", seed: int = 0, progress: Optional[Callable] = None
) -> List[CheckRow]:
    """``linear_logprobs`` and ``logprobs_from_logits`` on every backend (log-probs,
    entropies, gradients with random upstream), diffed against the fp64 reference."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, case_kw, via_logits in _logprobs_check_cases():
        inputs = random_logprobs_case(gen, device=device, **case_kw)
        if via_logits:
            inputs = logits_case_from(inputs)
        up = logprobs_upstream(inputs, gen)
        ref64 = run_logprobs(as_float64(inputs), "reference", up)
        same = run_logprobs(inputs, "reference", up)
        dt = inputs["logits" if via_logits else "hidden"].dtype
        scale = logit_scale(inputs)
        op = "logprobs_from_logits" if via_logits else "linear_logprobs"
        for backend in backends:
            rows.append(
                _check_row(
                    op,
                    backend,
                    name.split(": ", 1)[1],
                    lambda: compare_logprobs(run_logprobs(inputs, backend, up), ref64, same, dt, scale),
                )
            )
            if progress:
                progress()
    return rows


def logprobs_check_case_count() -> int:
    return len(_logprobs_check_cases())
