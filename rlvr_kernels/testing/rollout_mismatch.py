"""``rollout_mismatch``: random cases, comparisons and the ``rlvr-kernels check`` suite."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from ..contracts.rollout_mismatch import RolloutMismatch
from ..reference.rollout_mismatch import valid_tokens
from ._checks import CheckRow, CheckSuite, check_row
from ._compare import Comparison, as_float64, compare

# The fields whose terms may cancel, and the field holding the mean magnitude of their terms.
_MAGNITUDE = {
    "k1": "abs_diff_mean",
    "log_ppl_diff": "log_ppl_abs_diff",
    "log_ppl_diff_max": "log_ppl_abs_diff",
    "log_ppl_diff_min": "log_ppl_abs_diff",
}


def compare_mismatch(
    fast: RolloutMismatch, ref64: RolloutMismatch, same: RolloutMismatch, inputs: Dict
) -> List[Comparison]:
    """Every field under the tolerance rule, each mean with the summation allowance of its
    terms (``reduction``): n = the valid tokens, S = the mean magnitude of the terms (the
    χ² fields' terms are ρ², of mean χ² + 1; a sequence's Σ Δ: its Σ |Δ|, the largest of
    them, over the longest sequence's count)."""
    n = int(ref64.num_tokens)
    _, _, _, seq, B = valid_tokens(
        inputs["train_logprobs"], inputs["rollout_logprobs"], inputs.get("response_mask"), inputs.get("cu_seqlens")
    )
    counts = torch.bincount(seq.cpu(), minlength=B).double()
    seq_abs = float((ref64.per_seq_abs_diff_mean.double().cpu() * counts).max()) if B else 0.0
    longest = int(counts.max()) if B else 0
    out = []
    for name in RolloutMismatch._fields:
        r = getattr(ref64, name)
        if name == "num_tokens":
            out.append(compare(name, getattr(fast, name), r, getattr(same, name), torch.float32))
            continue
        if name.startswith("chi2"):
            magnitude = float(r.abs().max()) + 1.0
        elif name == "per_seq_log_ratio":
            out.append(
                compare(name, getattr(fast, name), r, getattr(same, name), torch.float32, reduction=(seq_abs, longest))
            )
            continue
        else:
            magnitude = float(getattr(ref64, _MAGNITUDE.get(name, name)).abs().max()) if r.numel() else 0.0
        red = (magnitude, n)
        out.append(compare(name, getattr(fast, name), r, getattr(same, name), torch.float32, reduction=red))
    return out


def random_mismatch_case(
    gen: torch.Generator,
    *,
    B: int = 13,
    L: int = 37,
    layout: str = "padded",
    dtype: torch.dtype = torch.float32,
    noise: float = 0.05,
    mask_fraction: float = 0.2,
    empty_rows: int = 1,
    mask_dtype: torch.dtype = torch.bool,
    device: str = "cpu",
) -> Dict:
    """Fresh random inputs: train log-probs in [−4, 0], rollout = train + noise·(normal, a
    few heavy-tailed tokens), ragged lengths with ``empty_rows`` empty sequences, a random
    token mask; padding (and packed tokens past the last span) holds NaN, which must never
    reach a result."""
    lengths = torch.randint(0, L + 1, (B,), generator=gen)
    if B:
        lengths[torch.randperm(B, generator=gen)[: min(empty_rows, B)]] = 0
    if layout == "padded":
        shape = (B, L)
        inside = torch.arange(L)[None, :] < lengths[:, None]
        cu = None
    else:
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        T = int(cu[-1]) + 3
        shape = (T,)
        inside = torch.arange(T) < int(cu[-1])
    train = -4 * torch.rand(shape, generator=gen)
    spikes = torch.rand(shape, generator=gen) < 0.05
    delta = noise * torch.randn(shape, generator=gen) * torch.where(spikes, 20.0, 1.0)
    rollout = train - delta
    mask = inside & (torch.rand(shape, generator=gen) >= mask_fraction)
    train = train.masked_fill(~mask, float("nan")).to(dtype)
    rollout = rollout.masked_fill(~mask, float("nan")).to(dtype)
    kwargs = dict(train_logprobs=train, rollout_logprobs=rollout, response_mask=mask.to(mask_dtype), cu_seqlens=cu)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


# (name, case arguments): the cases `rlvr-kernels check` runs on every backend.
def check_cases() -> List[tuple]:
    return [
        ("padded fp32", dict(layout="padded")),
        ("packed fp32", dict(layout="packed")),
        ("padded bf16, 0/1 float mask", dict(layout="padded", dtype=torch.bfloat16, mask_dtype=torch.float32)),
        ("packed fp64", dict(layout="packed", dtype=torch.float64)),
        ("packed B=24 L=150, large noise", dict(layout="packed", B=24, L=150, empty_rows=3, noise=0.5)),
        ("all masked", dict(layout="padded", mask_fraction=1.0)),
    ]


def run_mismatch(inputs: Dict, backend: str, **kw) -> RolloutMismatch:
    from .. import rollout_mismatch

    return rollout_mismatch(**inputs, backend=backend, **kw)


def reference_pair(inputs: Dict, **kw):
    """(ref64, same): the reference on float64 copies and in the inputs' own dtype."""
    return run_mismatch(as_float64(inputs), "reference", **kw), run_mismatch(inputs, "reference", **kw)


def check_rollout_mismatch(
    backends: List[str], device: str = "cpu", seed: int = 0, progress: Optional[Callable] = None
) -> List[CheckRow]:
    """Every backend on fresh random inputs, diffed against the fp64 reference."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for name, case_kw in check_cases():
        inputs = random_mismatch_case(gen, device=device, **case_kw)
        ref64, same = reference_pair(inputs)
        for backend in backends:
            rows.append(
                check_row(
                    "rollout_mismatch",
                    backend,
                    name,
                    lambda: compare_mismatch(run_mismatch(inputs, backend), ref64, same, inputs),
                )
            )
            if progress:
                progress()
    return rows


SUITE = CheckSuite("rollout_mismatch", check_cases, check_rollout_mismatch)
