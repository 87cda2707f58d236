"""``linear_logprobs`` / ``logprobs_from_logits``: random cases, the forward/backward runner,
comparisons and the ``rlvr-kernels check`` suite."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch

from ._checks import CheckRow, CheckSuite, check_row
from ._compare import Comparison, as_float64, compare


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
    from .. import linear_logprobs, logprobs_from_logits

    kw = dict(inputs)
    names = ["logits"] if "logits" in kw else ["hidden", "weight"] + (["bias"] if kw.get("bias") is not None else [])
    leaves = {n: kw[n].detach().clone().requires_grad_(True) for n in names}
    kw.update(leaves)
    fn = logprobs_from_logits if "logits" in kw else linear_logprobs
    res = fn(**kw, backend=backend)
    logp, entropy = res.logp, res.entropy
    outside = res.outside_support
    # A target outside a sampling support has log-prob −inf: compared as 0 (and through
    # ``outside``), with no gradient.
    logp = torch.where(outside, torch.zeros_like(logp), logp)
    out = {"logp": logp.detach(), "entropy": entropy.detach()}
    if upstream is not None:
        loss = (logp * upstream["logp"].to(logp)).sum() + (entropy * upstream["entropy"].to(entropy)).sum()
        if loss.requires_grad:
            loss.backward()
        for n, leaf in leaves.items():
            out[f"grad.{n}"] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    out["outside"] = outside
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
        if k != "outside"  # (bool: compared exactly by the callers)
    ]


def assert_matches_reference(inputs: Dict, backend: str, gen: torch.Generator) -> None:
    """One case on ``backend`` under random upstream gradients against the fp64 reference
    (:func:`compare_logprobs`), and the invariants: log p ≤ 0, 0 ≤ entropy ≤ log V."""
    up = logprobs_upstream(inputs, gen)
    ref64 = run_logprobs(as_float64(inputs), "reference", up)
    same = run_logprobs(inputs, "reference", up)
    fast = run_logprobs(inputs, backend, up)
    in_dtype = inputs["logits" if "logits" in inputs else "hidden"].dtype
    bad = [c for c in compare_logprobs(fast, ref64, same, in_dtype, logit_scale(inputs)) if not c.ok]
    assert not bad, bad
    if "outside" in ref64:
        assert torch.equal(fast["outside"].cpu(), ref64["outside"].cpu()), "outside_support differs"
    vocab = (inputs["logits"] if "logits" in inputs else inputs["weight"]).shape[-1 if "logits" in inputs else 0]
    assert bool((fast["logp"] <= 0).all()), "a log-prob is positive"
    assert bool((fast["entropy"] >= 0).all() & (fast["entropy"] <= math.log(vocab)).all())


def check_cases() -> List[tuple]:
    """(name, random_logprobs_case kwargs, via logits?, extra op kwargs): small enough for the
    Triton interpreter."""
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
    cases = [(f"linear: {n}", kw, False, {}) for n, kw in base]
    cases += [(f"logits: {base[i][0]}", base[i][1], True, {}) for i in (0, 1, 4, 6)]
    # Sampling supports (docs/logprobs.md, "Sampling support"), in fp64 so the kept set is the
    # reference's exactly.
    f64 = dict(dtype=torch.float64)
    cases += [
        ("linear: top-k 20 + top-p 0.8 + min-p 0.01", f64, False, dict(top_k=20, top_p=0.8, min_p=0.01)),
        ("linear: sglang top-p 0.9, bias", dict(f64, bias=True), False, dict(top_p=0.9, sampling_convention="sglang")),
        ("logits: top-p 0.7", f64, True, dict(top_p=0.7)),
    ]
    return cases


def check_logprobs(
    backends: List[str], device: str = "cpu", seed: int = 0, progress: Optional[Callable] = None
) -> List[CheckRow]:
    """``linear_logprobs`` and ``logprobs_from_logits`` on every backend (log-probs,
    entropies, gradients with random upstream), diffed against the fp64 reference."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, case_kw, via_logits, extra in check_cases():
        inputs = random_logprobs_case(gen, device=device, **case_kw)
        if via_logits:
            inputs = logits_case_from(inputs)
        inputs.update(extra)
        up = logprobs_upstream(inputs, gen)
        ref64 = run_logprobs(as_float64(inputs), "reference", up)
        same = run_logprobs(inputs, "reference", up)
        dt = inputs["logits" if via_logits else "hidden"].dtype
        scale = logit_scale(inputs)
        op = "logprobs_from_logits" if via_logits else "linear_logprobs"
        for backend in backends:
            rows.append(
                check_row(
                    op,
                    backend,
                    name.split(": ", 1)[1],
                    lambda: compare_logprobs(run_logprobs(inputs, backend, up), ref64, same, dt, scale),
                )
            )
            if progress:
                progress()
    return rows


SUITE = CheckSuite("linear_logprobs", check_cases, check_logprobs)
