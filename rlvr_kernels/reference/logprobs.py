"""Reference for docs/logprobs.md: log-probs and entropy from hidden states and the LM head, or
from logits. It materialises the ``[N, V]`` logits (small sizes only) and leaves the
gradients to autograd, so it is the formula and nothing else. Everything is computed in
fp64 when the inputs are fp64, else in fp32 from the inputs upcast."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .._core.layout import compute_dtype as _compute_dtype
from .._core.rounding import round_bf16, round_tf32

# The optional per-row / per-target statistics of ``linear_logprobs`` (``outputs=``).
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Whose top-k / top-p / min-p a computed sampling support follows (docs/logprobs.md).
SAMPLING_CONVENTIONS = ("vllm", "sglang")


def sampling_threshold(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, convention: str = "vllm"
) -> torch.Tensor:
    """The least kept value of each row of z [N, V] (−inf: every column kept) under the rollout
    engine's filters, by sorting (the definition the kernels meet without a sort):

    - min-p (0 < min_p[n]): keep z_v with exp(z_v − max z) >= min_p;
    - top-k (0 < top_k[n] < V): keep z_v >= the top_k-th largest value (a tie with it is kept
      whole);
    - top-p (top_p[n] < 1), on U, the columns both keep: keep v in U when B(v), the mass of U
      strictly above z_v (in exp(z − max) units), is < top_p · (the mass of U) ("vllm": the
      survivors renormalised, strict) or <= top_p · (the mass of the whole row) ("sglang").

    The kept set is {v : z_v >= threshold}: every filter keeps an upper set of values, so
    their composition does too. No gradient (the support is a constant of the loss)."""
    if convention not in SAMPLING_CONVENTIONS:
        raise ValueError(f"convention: expected one of {SAMPLING_CONVENTIONS}, got {convention!r}")
    with torch.no_grad():
        z = z.detach()
        n, v = z.shape
        neg_inf = torch.full((n,), float("-inf"), dtype=z.dtype, device=z.device)
        if n == 0:
            return neg_inf
        m = z.amax(-1, keepdim=True)
        e = torch.exp(z - m)
        desc = torch.sort(z, dim=-1, descending=True).values
        # min-p: the least value whose exp(z − max) reaches min_p.
        min_p = min_p.to(z.dtype).reshape(n, 1)
        minp_keep = e >= min_p
        t_min = torch.where(minp_keep, z, torch.full_like(z, float("inf"))).amin(-1)
        t_min = torch.where(min_p[:, 0] > 0, t_min, neg_inf)
        # top-k: the k-th largest value, counted with multiplicity.
        k = top_k.long().reshape(n)
        k_on = (k > 0) & (k < v)
        t_k = desc.gather(1, (k.clamp(1, v) - 1)[:, None])[:, 0]
        t_k = torch.where(k_on, t_k, neg_inf)
        t1 = torch.maximum(t_min, t_k)
        in_u = z >= t1[:, None]
        mass_u = torch.where(in_u, e, torch.zeros_like(e))
        # B(v) = mass of U strictly above z_v = (mass of U) − (mass of U at or below z_v).
        asc_mass = torch.sort(torch.where(in_u, z, torch.full_like(z, float("-inf"))), dim=-1)
        below = torch.cumsum(torch.exp(asc_mass.values - m).nan_to_num(0.0), dim=-1)
        total_u = mass_u.sum(-1, keepdim=True)
        count_le = torch.searchsorted(asc_mass.values.contiguous(), z.contiguous(), right=True)
        le_mass = torch.where(count_le > 0, below.gather(1, (count_le - 1).clamp(min=0)), torch.zeros_like(z))
        above = (total_u - le_mass).clamp(min=0.0)
        top_p = top_p.to(z.dtype).reshape(n, 1)
        if convention == "vllm":
            keep_p = above < top_p * total_u
        else:
            keep_p = above <= top_p * e.sum(-1, keepdim=True)
        keep_p = keep_p & in_u
        t_p = torch.where(keep_p, z, torch.full_like(z, float("inf"))).amin(-1)
        t_p = torch.where(top_p[:, 0] < 1, t_p, neg_inf)
        return torch.maximum(t1, t_p)


def support_bits(support_ids: torch.Tensor, support_offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The MASK support the kernels take: int32 [N, ceil(V / 32)], bit (v % 32) of word v // 32
    of row n set iff id v in [0, V) is among support_ids[support_offsets[n] :
    support_offsets[n + 1]] (the offsets clamped to [0, nnz]; a reversed range is empty)."""
    n, nnz = support_offsets.shape[0] - 1, support_ids.shape[0]
    words = (vocab + 31) // 32
    mask = torch.zeros((n, words * 32), dtype=torch.bool, device=support_ids.device)
    off = support_offsets.long().clamp(0, nnz).tolist()
    for r in range(n):
        ids = support_ids[off[r] : max(off[r], off[r + 1])].long()
        mask[r, ids[(ids >= 0) & (ids < vocab)]] = True
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=mask.device), torch.arange(32))
    packed = (mask.reshape(n, words, 32).long() * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement words


def support_mask(
    n: int,
    vocab: int,
    device,
    *,
    support_ids: Optional[torch.Tensor] = None,
    support_offsets: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    top_k=None,
    top_p=None,
    min_p=None,
    convention: str = "vllm",
) -> Optional[torch.Tensor]:
    """The kept columns [N, V] bool of a sampling support: the explicit CSR (ids of row n in
    support_ids[support_offsets[n]:support_offsets[n + 1]], duplicates allowed, ids outside
    [0, V) ignored) or the engine's filters on z (:func:`sampling_threshold`); None without."""
    if support_ids is not None:
        offsets = support_offsets.long()
        counts = offsets[1:] - offsets[:-1]
        rows = torch.repeat_interleave(torch.arange(n, device=device), counts)
        ids = support_ids.long()
        ok = (ids >= 0) & (ids < vocab)
        mask = torch.zeros((n, vocab), dtype=torch.bool, device=device)
        mask[rows[ok], ids[ok]] = True
        return mask
    if top_k is None and top_p is None and min_p is None:
        return None

    def per_row(x, off, dtype):
        if x is None:
            return torch.full((n,), off, dtype=dtype, device=device)
        if isinstance(x, torch.Tensor):
            return x.to(device=device, dtype=dtype).reshape(-1).expand(n)
        return torch.full((n,), x, dtype=dtype, device=device)

    k = per_row(top_k, 0, torch.int64)
    p = per_row(top_p, 1.0, z.dtype)
    mp = per_row(min_p, 0.0, z.dtype)
    return z >= sampling_threshold(z, k, p, mp, convention)[:, None]


def _head(hidden, weight, bias, dt, logits_precision: str) -> torch.Tensor:
    """y = hidden·Wᵀ + b in dt after the rounding steps of ``logits_precision``; the gradient
    is that of the unrounded y (straight through every rounding: d hidden = dy·W with the
    operands as given)."""

    def linear(h, w, b):
        y = h.to(dt) @ w.to(dt).T
        return y if b is None else y + b.to(dt)

    y = linear(hidden, weight, bias)
    if logits_precision == "fp32":
        return y
    if logits_precision == "bf16":
        rounded = round_bf16(linear(round_bf16(hidden), round_bf16(weight), None if bias is None else round_bf16(bias)))
    else:
        rounded = linear(round_tf32(hidden), round_tf32(weight), bias)
    return y + (rounded - y).detach()


def _per_row(temperature, n: int, like: torch.Tensor) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        return temperature.to(device=like.device, dtype=like.dtype).reshape(-1).expand(n)
    return torch.full((n,), float(temperature), device=like.device, dtype=like.dtype)


def _from_scaled_logits(z, targets, row_index, ignore_index, return_entropy, kept=None):
    """log p of each target and the entropy of each row, from temperature-scaled logits z;
    with ``kept`` [N, V] bool, of the distribution restricted to the kept columns (a target
    outside gets −inf, an empty row has entropy 0)."""
    rows = torch.arange(z.shape[0], device=z.device) if row_index is None else row_index.long()
    ignored = targets == ignore_index
    safe = torch.where(ignored, torch.zeros_like(targets), targets).long()
    if kept is None:
        log_p = torch.log_softmax(z, dim=-1)
        p_log_p = log_p.exp() * log_p
    else:
        masked = torch.where(kept, z, torch.full_like(z, float("-inf")))
        nonempty = kept.any(-1, keepdim=True)
        log_p = torch.log_softmax(torch.where(nonempty, masked, torch.zeros_like(z)), dim=-1)
        log_p = torch.where(kept, log_p, torch.full_like(log_p, float("-inf")))
        p_log_p = torch.where(kept, log_p.exp() * torch.where(kept, log_p, torch.zeros_like(log_p)), 0.0)
    logp = log_p[rows, safe].masked_fill(ignored, 0.0)
    if not return_entropy:
        return logp
    entropy = -p_log_p.sum(-1)
    return logp, entropy


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    row_index: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 1.0,
    bias: Optional[torch.Tensor] = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    outputs: Sequence[str] = (),
    logits_precision: str = "fp32",
    support_ids: Optional[torch.Tensor] = None,
    support_offsets: Optional[torch.Tensor] = None,
    top_k=None,
    top_p=None,
    min_p=None,
    sampling_convention: str = "vllm",
    keep_targets: bool = False,
) -> Union[torch.Tensor, tuple]:
    """y = hidden·Wᵀ + b; z_n = softcap·tanh(logit_scale·y_n / softcap) / T_n (without a
    softcap: logit_scale·y_n / T_n); logp_m = z_{row(m), t_m} − logsumexp(z_{row(m)}) (0 for
    ignored targets); entropy_n = logsumexp(z_n) − Σ_v softmax(z_n)_v z_{n,v}.

    With ``outputs`` (names from :data:`OPTIONAL_OUTPUTS`) the result is the 5-tuple
    (logp, entropy, log_sum_sq_probs, mean_logits, is_top1), None where not requested:
    log_sum_sq_probs_n = log Σ_v softmax(z_n)_v², mean_logits_n = mean_v z_{n,v}, is_top1_m =
    (t_m is the first argmax of z_{row(m)}) and t_m is not ignored.

    ``logits_precision``: "tf32" rounds hidden and W to tf32 first (:func:`round_tf32`);
    "bf16" rounds hidden, W and b to bf16 and then y itself (:func:`round_bf16`). The
    gradient passes straight through every rounding (that of the unrounded y).

    A sampling support (``support_ids`` + ``support_offsets``, or ``top_k`` / ``top_p`` /
    ``min_p`` with ``sampling_convention``; :func:`support_mask`) restricts every row's
    distribution to its kept columns after the temperature (a target outside gets −inf; with
    ``keep_targets`` it joins its row's kept columns instead, unless its z is −inf); the
    result is then the 5-tuple (logp, entropy or None, None, None, None)."""
    dt = _compute_dtype(hidden.dtype)
    z = _head(hidden, weight, bias, dt, logits_precision)
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / _per_row(temperature, hidden.shape[0], z)[:, None]
    kept = support_mask(
        z.shape[0],
        z.shape[1],
        z.device,
        support_ids=support_ids,
        support_offsets=support_offsets,
        z=z,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        convention=sampling_convention,
    )
    if kept is not None:
        if keep_targets:
            kept = _with_targets(kept, z, targets, row_index, ignore_index)
        return _with_support(z, kept, targets, row_index, ignore_index, "entropy" in outputs or return_entropy)
    if not outputs:
        return _from_scaled_logits(z, targets, row_index, ignore_index, return_entropy)
    logp, entropy = _from_scaled_logits(z, targets, row_index, ignore_index, True)
    log_p = torch.log_softmax(z, dim=-1)
    rows = torch.arange(z.shape[0], device=z.device) if row_index is None else row_index.long()
    top1 = (z.argmax(-1)[rows] == targets.long()) & (targets != ignore_index)
    return (
        logp,
        entropy if "entropy" in outputs else None,
        torch.logsumexp(2 * log_p, dim=-1).detach() if "log_sum_sq_probs" in outputs else None,
        z.mean(-1).detach() if "mean_logits" in outputs else None,
        top1 if "is_top1" in outputs else None,
    )


def _with_targets(kept, z, targets, row_index, ignore_index) -> torch.Tensor:
    """kept [N, V] with each (non-ignored) target's column of its row added where z is finite."""
    rows = torch.arange(z.shape[0], device=z.device) if row_index is None else row_index.long()
    use = targets != ignore_index
    rows, cols = rows[use], targets[use].long()
    rows, cols = rows[torch.isfinite(z[rows, cols])], cols[torch.isfinite(z[rows, cols])]
    kept = kept.clone()
    kept[rows, cols] = True
    return kept


def _with_support(z, kept, targets, row_index, ignore_index, return_entropy) -> tuple:
    """(logp, entropy or None, None, None, None) of the restricted rows."""
    logp, entropy = _from_scaled_logits(z, targets, row_index, ignore_index, True, kept)
    return logp, entropy if return_entropy else None, None, None, None


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Union[float, torch.Tensor] = 1.0,
    return_entropy: bool = False,
    *,
    ignore_index: int = -100,
    logits_precision: str = "fp32",
    support_ids: Optional[torch.Tensor] = None,
    support_offsets: Optional[torch.Tensor] = None,
    top_k=None,
    top_p=None,
    min_p=None,
    sampling_convention: str = "vllm",
    keep_targets: bool = False,
) -> Union[torch.Tensor, tuple]:
    """The same from logits ``[..., V]`` with targets ``[...]``; outputs are shaped like
    ``targets``. A per-row temperature tensor is shaped like ``targets`` (or broadcastable).
    ``logits_precision`` "bf16" rounds the logits to bf16 first (straight-through). With a
    sampling support (rows = the flattened leading dimensions; as in :func:`linear_logprobs`)
    the result is (logp, entropy or None), each shaped like ``targets``."""
    dt = _compute_dtype(logits.dtype)
    lead = targets.shape
    z = logits.to(dt).reshape(-1, logits.shape[-1])
    if logits_precision == "bf16":
        z = z + (round_bf16(z) - z).detach()
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(dt).expand(lead).reshape(-1)
    z = z / _per_row(temperature, z.shape[0], z)[:, None]
    kept = support_mask(
        z.shape[0],
        z.shape[1],
        z.device,
        support_ids=support_ids,
        support_offsets=support_offsets,
        z=z,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        convention=sampling_convention,
    )
    if kept is not None:
        if keep_targets:
            kept = _with_targets(kept, z, targets.reshape(-1), None, ignore_index)
        logp, entropy, *_ = _with_support(z, kept, targets.reshape(-1), None, ignore_index, return_entropy)
        return logp.reshape(lead), None if entropy is None else entropy.reshape(lead)
    out = _from_scaled_logits(z, targets.reshape(-1), None, ignore_index, return_entropy)
    if not return_entropy:
        return out.reshape(lead)
    return out[0].reshape(lead), out[1].reshape(lead)
