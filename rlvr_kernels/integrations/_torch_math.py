"""The lean-torch arithmetic of the drop-ins, one implementation for every integration:
the KL penalty estimators and the loss aggregation modes that a drop-in reproduces in
plain torch (elementwise work and one masked reduction: no kernel is faster), with each
peer's conventions as arguments, so that every peer's numbers come out of the same code.

KL estimators (:func:`kl_estimate`), y = ref − logp, per token:

==================  ===============================================================
"kl" / "k1"         logp − ref
"abs"               |logp − ref|
"mse" / "k2"        ½ (logp − ref)²
"low_var_kl" / "k3" e^y − y − 1; ``clamp=True`` (verl): y clamped to ±20, the value
                    to ±10; ``clamp=False`` (TRL): unclamped
"<kind>+"           the value of <kind> with the gradient of k2 (verl's straight-through)
==================  ===============================================================

Aggregation (:func:`aggregate`) of a per-token ``x [B, T]`` under ``mask [B, T]``:

=========================  ========================================================
"token-mean"               Σ x·m / N (N: the global token count, else Σ m)
"token-sum"                Σ x·m
"seq-mean-token-sum"       Σ_i (Σ_t x·m) / S (S: the global sequence count, else the
                           local one)
"seq-mean-token-mean"      Σ_i (Σ_t x·m / n_i) / S
"seq-mean-token-sum-norm"  Σ_i (Σ_t x·m) / S / loss_scale_factor (default T)
=========================  ========================================================

``convention="verl"``: verl's ``agg_loss`` arithmetic in its order (n_i + 1e-8, S counts
the sequences with a valid token, × dp_size), with 0 where verl divides by a count of 0
(NaN there). ``convention="trl"``: the normalisers of TRL's ``GRPOTrainer._compute_loss``
(n_i and Σ m clamped at 1, S = B: empty rows count, as TRL's ``.mean()``).

Discounted returns (:func:`discounted_returns`) of a ``[B, L]`` batch, the recurrence of
REINFORCE returns and of GAE (on the TD errors, with γλ) that slime and OpenRLHF run as a
Python loop over the tokens: a blocked scan, L / 128 steps.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._core.layout import safe_div as _safe_div  # 0 where verl's divisor is 0 (verl gives NaN)

__all__ = ["AGG_MODES", "KL_KINDS", "aggregate", "discounted_returns", "kl_estimate", "times_mask"]

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
_K3_KINDS = ("low_var_kl", "k3", "low_var_kl+", "k3+")


# =======================================================================================
# KL estimators
# =======================================================================================


def kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str, *, clamp: bool = True) -> torch.Tensor:
    """The per-token KL estimate ``kind`` (module docstring; broadcasting as torch's).
    Same-shaped, same-dtype clamped k3 / k3+ run in :class:`_K3` (the same values, a
    one-multiply backward); everything else is the formula as written."""
    if (
        clamp
        and kind in _K3_KINDS
        and ref_logprob.shape == logprob.shape
        and ref_logprob.dtype == logprob.dtype
        and ref_logprob.device == logprob.device
    ):
        return _K3.apply(logprob, ref_logprob, kind.endswith("+"))
    return _kl_torch(logprob, ref_logprob, kind, clamp)


class _K3(torch.autograd.Function):
    """verl's k3 ("low_var_kl") and k3+ in one forward: the value is verl's expression in
    verl's order (bit for bit); the backward is one multiply by a derivative kept from the
    forward. k3: d/dlogp = −(e^y − 1) where neither of verl's clamps (y = ref − logp to
    ±20, the value to ±10) is active, else 0 — clamp's gradient passes at the bounds, as
    torch's does. k3+: the gradient of k2, logp − ref (verl's straight-through)."""

    @staticmethod
    def forward(ctx, logprob: torch.Tensor, ref_logprob: torch.Tensor, plus: bool) -> torch.Tensor:
        # Three [B, L] buffers (kl, y, ratio), reused in place: on CPU each fresh buffer of
        # this size costs page faults comparable to the arithmetic.
        grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        kl = torch.sub(ref_logprob, logprob)
        y = kl.clamp(-20, 20)
        ratio = torch.exp(y)
        if plus:
            value = ratio.sub_(y).sub_(1)  # verl: (ratio - kl - 1), with kl clamped
            if grad:
                ctx.save_for_backward(kl.neg_())  # k2's derivative, logp − ref
        else:
            drop = torch.ne(y, kl) if grad else None  # y clamped (or NaN: no gradient, as clamp's)
            value = torch.sub(ratio, y, out=kl).sub_(1)
            if grad:
                drop.logical_or_(value > 10)  # (the value is >= 0 up to rounding: -10 never binds)
                ctx.save_for_backward(ratio.sub_(1).neg_().masked_fill_(drop, 0.0))
        return value.clamp_(-10, 10)

    @staticmethod
    def backward(ctx, grad):
        (derivative,) = ctx.saved_tensors
        g = grad * derivative
        return (g if ctx.needs_input_grad[0] else None), (-g if ctx.needs_input_grad[1] else None), None


def _kl_torch(logprob, ref_logprob, kind: str, clamp: bool):
    """The estimators as written in verl's ``kl_penalty`` (for the estimators other than
    k3, for broadcast or mixed-dtype inputs, and unclamped)."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base in ("kl", "k1"):
        value = logprob - ref_logprob
    elif base == "abs":
        value = (logprob - ref_logprob).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (logprob - ref_logprob).square()
    elif base in ("low_var_kl", "k3"):
        if clamp:
            kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
            value = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
        else:
            kl = ref_logprob - logprob
            value = torch.exp(kl) - kl - 1
    elif base == "full":
        raise NotImplementedError("kl_penalty: 'full' needs every token's logits (verl raises too)")
    else:
        raise NotImplementedError(f"kl_penalty: unknown estimator {kind!r}; verl's are {KL_KINDS} (+ a '+' suffix)")
    if not kind.endswith("+") or kind in ("mse", "k2"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()  # straight-through: the value of `base`, the gradient of k2
    return k2 - k2.detach() + value.detach()


# =======================================================================================
# Aggregation
# =======================================================================================


class _MaskedSum(torch.autograd.Function):
    """verl's ``masked_sum``, Σ where(m ≠ 0, x, 0)·m over ``dim`` (None: everything), as
    Σ x·m: where x is finite the products are the same numbers (x·1 = x, x·0 = ±0), so
    the sum has the same bits. A bool mask is read as uint8 (no copy): float × uint8 is
    vectorised on CPU, float × bool and bool → float are not, and every fresh buffer of
    this size costs page faults, so forward and backward allocate one each (verl: a
    ``where``, a product and a cast forward, two backward). Only when the sum is not
    finite (a NaN / inf somewhere, maybe on padding, which verl's ``where`` zeroes) is it
    redone verl's way; on CUDA, where that check would be a host sync, verl's way always.
    The backward is grad·m."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
        m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        total = None
        if x.device.type == "cpu":
            total = _sum(times_mask(x, m), dim)
            if not bool(torch.isfinite(total).all()):
                total = None
        if total is None:
            total = _sum(torch.where(m != 0, x, 0.0).mul_(m), dim)
        ctx.save_for_backward(m)
        ctx.dim, ctx.x_shape = dim, x.shape
        return total

    @staticmethod
    def backward(ctx, grad):
        (m,) = ctx.saved_tensors
        if ctx.dim is not None:
            grad = grad.unsqueeze(ctx.dim)
        g = times_mask(grad, m)
        if tuple(g.shape) != tuple(ctx.x_shape):
            g = g.expand(torch.broadcast_shapes(g.shape, ctx.x_shape)).sum_to_size(ctx.x_shape)
        return g, None, None


def times_mask(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """t·m in t's dtype as one fresh buffer: the mask cast into it, then multiplied in place
    (``torch.mul`` of mixed dtypes casts into a temporary first: two buffers)."""
    dtype = torch.promote_types(t.dtype, m.dtype)
    if dtype == m.dtype or torch.broadcast_shapes(t.shape, m.shape) != m.shape:
        return torch.mul(t, m)
    return m.to(dtype).mul_(t)


def _sum(t: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    return t.sum() if dim is None else t.sum(dim)


def _masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    dt = torch.promote_types(x.dtype, mask.dtype)
    if dt != x.dtype:  # a float mask wider than x: verl's product is in the wider dtype
        x = x.to(dt)
    return _MaskedSum.apply(x, mask, dim)


def _counts(mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """``mask.sum(dim)`` (int64 for bool masks, as verl's); for a bool mask
    ``count_nonzero``, which does not first cast the whole mask to int64 as ``sum`` does."""
    if mask.dtype == torch.bool:
        return torch.count_nonzero(mask) if dim is None else torch.count_nonzero(mask, dim)
    return mask.sum() if dim is None else mask.sum(dim)


def _times(loss: torch.Tensor, dp: int) -> torch.Tensor:
    """loss · dp_size, skipped for 1 (x·1 = x: one small op fewer on the common path)."""
    return loss if dp == 1 else loss * dp


def _local_div(num: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """num / count for a count of tokens or sequences of a bool mask: when it is 0 nothing
    was summed (num = 0), so dividing by max(count, 1) gives verl's value or 0 in two ops."""
    return num / count.clamp(min=1)


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    dp: int = 1,
    global_num_tokens=None,
    global_num_seqs=None,
    loss_scale_factor=None,
    *,
    masked: bool = False,
    convention: str = "verl",
) -> torch.Tensor:
    """``x`` aggregated under ``mask`` with ``mode`` (module docstring), in the arithmetic
    of ``convention`` ("verl" or "trl"). ``dp``, ``global_num_tokens`` (N),
    ``global_num_seqs`` (S) and ``loss_scale_factor`` as verl's ``agg_loss`` takes them
    (dp_size, batch_num_tokens, global_batch_size); TRL's reads N and the factor only.
    ``masked`` (verl): x is already x·m (the mask only counts).

    verl: :func:`_masked_sum` for the token-level reductions and 0 for a count of 0. A
    bool mask (what verl's ppo_loss passes) takes shortcuts that give the same bits with
    fewer small ops: a row without a valid token has a per-sequence loss of exactly 0, so
    verl's masked sum over sequences is the plain sum, and the sequence count is
    ``count_nonzero``."""
    if convention == "trl":
        return _aggregate_trl(x, mask, mode, global_num_tokens, loss_scale_factor)
    if convention != "verl":
        raise ValueError(f"convention: expected 'verl' or 'trl', got {convention!r}")
    global_batch_size, batch_num_tokens = global_num_seqs, global_num_tokens
    local = mask.dtype == torch.bool

    def msum(dim=None):
        return _sum(x, dim) if masked else _masked_sum(x, mask, dim)

    if mode == "token-mean":
        total = msum()
        if batch_num_tokens is None:
            n = _counts(mask)
            return _times((_local_div(total, n) if local else _safe_div(total, n)), dp)
        return _times(_safe_div(total, batch_num_tokens), dp)
    if mode == "token-sum":
        return _times(msum(), dp)
    seq_losses = msum(-1)
    counts = _counts(mask, -1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (counts + 1e-8)
    if local:
        total = seq_losses.sum()
        if global_batch_size is None:
            loss = _times(_local_div(total, torch.count_nonzero(counts)), dp)
        else:
            loss = _times(_safe_div(total, global_batch_size), dp)
    else:
        seq_mask = (counts > 0).float()
        gbs = seq_mask.sum() if global_batch_size is None else global_batch_size
        loss = _times(_safe_div(torch.where(seq_mask.bool(), seq_losses, 0.0).mul(seq_mask).sum(), gbs), dp)
    if mode == "seq-mean-token-sum-norm":
        scale = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        if scale != 0:  # 0 only as the default L of an empty response: no tokens, loss 0
            loss = loss / scale
    return loss


def _aggregate_trl(per_token, mask, mode, global_num_tokens, loss_scale_factor) -> torch.Tensor:
    """TRL's normalisers (``GRPOTrainer._compute_loss``): x = per_token·m broadcast to
    the mask's [B, T]; n_i and Σ m clamped at 1; sequence means over all B rows. An empty
    batch (B = 0) gives 0 with zero gradient, where TRL's mean over no rows (and dr_grpo's
    Σ / (0·L)) is NaN."""
    m = mask.to(per_token.dtype) if mask.dtype == torch.bool else mask
    x = per_token.expand(mask.shape) * m
    if x.shape[0] == 0:
        return x.sum()
    if mode == "seq-mean-token-mean":
        return (x.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if mode == "token-mean":
        return x.sum() / (m.sum().clamp(min=1.0) if global_num_tokens is None else global_num_tokens)
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (x.shape[0] * loss_scale_factor)
    if mode == "seq-mean-token-sum":
        return x.sum(-1).mean()
    if mode == "token-sum":
        return x.sum()
    raise ValueError(f"mode: expected one of {AGG_MODES}, got {mode!r}")


# Tokens per block of discounted_returns: the in-block matrix is C × C, the loop over
# blocks L / C steps.
_SCAN_BLOCK = 128


def discounted_returns(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """G[:, t] = Σ_{s ≥ t} γ^(s − t) x[:, s] for a ``[B, L]`` tensor, as a blocked scan: within a
    block of C tokens one ``[·, C] @ [C, C]`` product with the matrix of powers γ^(j − i), and
    the carry from the block after it multiplied by γ^(C − i). Zeros after a row's end leave
    its returns unchanged."""
    B, L = x.shape
    if L == 0:
        return x.clone()
    C = _SCAN_BLOCK
    nb = (L + C - 1) // C
    xp = torch.nn.functional.pad(x, (0, nb * C - L)).view(B, nb, C)
    i = torch.arange(C, device=x.device)
    expo = (i[:, None] - i[None, :]).to(x.dtype)  # [s, t] -> s − t
    gam = torch.tensor(gamma, dtype=x.dtype, device=x.device)
    # M[s, t] = γ^(s − t) for s >= t (0 ** 0 = 1 keeps the diagonal for γ = 0).
    M = torch.where(expo >= 0, gam.pow(expo.clamp_min(0)), torch.zeros((), dtype=x.dtype, device=x.device))
    local = torch.einsum("bks,st->bkt", xp, M)  # each block's returns with a zero carry
    carry_pow = gam.pow((C - i).to(x.dtype))  # γ^(C − t): distance to the next block's first token
    out = torch.empty_like(local)
    carry = x.new_zeros(B)
    for k in range(nb - 1, -1, -1):
        out[:, k] = local[:, k] + carry[:, None] * carry_pow
        carry = out[:, k, 0]
    return out.reshape(B, nb * C)[:, :L]
