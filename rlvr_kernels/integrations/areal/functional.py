"""Drop-ins for ``areal.utils.functional`` (AReaL 1.0.4): ``ppo_actor_loss_fn`` and
``sapo_loss_fn``, AReaL's signatures and returns ``(loss, stat)``, the loss and its gradient
from one fused ``policy_loss`` call (``preset="areal"``: no clamp of δ, every estimate as AReaL).

How AReaL's loss (``areal/utils/functional/functional.py``) maps onto the op:

- the ratio is π_θ / π_prox: the op's ``old_logprobs`` are AReaL's ``proximal_logprobs``
  (decoupled PPO; without it AReaL passes the same tensor twice);
- the loss is Σ over the kept tokens / the number of valid tokens BEFORE rejection (AReaL's
  ``loss_mask_count``, 1 for an empty mask): ``agg="none"`` and that one sum;
- ``rejection_sampling``: its mask and weights w (:mod:`._rejection`) are the op's mask and
  w·A: the PPO and SAPO terms are positively homogeneous in A per token (their branches and
  temperatures read only the sign of A), so w·pg(A) = pg(w·A) for w >= 0, values and gradients;
- ``importance_sampling_level="sequence"`` (GSPO): the advantages are their sequence mean over
  the kept tokens and the op's ``"gspo"`` ratio exp(mean δ); AReaL's ratio is one function of
  the whole sequence, so every token's term sends its gradient to each log-prob of the
  sequence. The op attributes it to the token's own log-prob; feeding it sg(x) + (x̄ − sg(x̄)),
  x̄ the sequence's masked mean, spreads it over the sequence as AReaL does (equal when the
  weights are constant along it, different with token-level rejection weights otherwise).
  ``c_clip`` applies there too (AReaL bounds every term): ``gspo_dual_clip``. SAPO at the
  sequence level feeds the op the sequence's mean log-ratio (same spreading) as a token ratio.

The ``stat`` dict (what ``grpo_loss_fn`` logs) is AReaL's, per token and detached, formed
without gradient; ``loss`` is the op's per-token loss.

``gather_logprobs`` / ``gather_logprobs_entropy`` (``areal/utils/functional/vocab_parallel.py``:
``log_softmax`` of ``logits.float() / temperature`` per chunk of rows, ``torch.compile``-d) are
one ``logprobs_from_logits`` pass over each row, no ``[rows, vocab]`` temporaries; fp32 results,
as AReaL's. A ``tp_group`` of more than one rank (AReaL's vocabulary-parallel path) raises
NotImplementedError.
"""

from __future__ import annotations

import torch

from ...ops.logprobs import logprobs_from_logits as _logprobs_from_logits
from ...ops.policy_loss import policy_loss as _policy_loss
from ...options import resolve_policy_loss_options
from .._backend import current_backend
from .._errors import caller_names
from .._patch import record
from . import _rejection

__all__ = ["ppo_actor_loss_fn", "sapo_loss_fn", "gather_logprobs", "gather_logprobs_entropy"]

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# the op's argument names -> AReaL's
_NAMES = {
    "old_logprobs": "proximal_logprobs",
    "mask": "loss_mask",
    "clip_low": "eps_clip",
    "clip_high": "eps_clip_higher",
    "clip_ratio_c": "c_clip",
}
_SAPO_NAMES = {"mask": "loss_mask"}


def _check_level(importance_sampling_level) -> None:
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level: expected one of {IMPORTANCE_SAMPLING_LEVELS}, "
            f"got {importance_sampling_level!r}"
        )


def _layout(x: torch.Tensor, cu_seqlens, sequence: bool):
    """The op's ``cu_seqlens``: AReaL's for the packed layout (a 1-D tensor without them is one
    sequence at the token level, where the boundaries do not matter), None for the padded one."""
    if x.dim() == 2:
        return None
    if cu_seqlens is None:
        if sequence:
            raise ValueError("cu_seqlens: required for 1-D (packed) tensors with importance_sampling_level='sequence'")
        return torch.tensor([0, x.shape[0]], dtype=torch.int32, device=x.device)
    return cu_seqlens


def _seq_mean(values: torch.Tensor, keep: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """Each token's sequence mean of ``values`` over the kept tokens (0 for a sequence without
    one), differentiable, shaped like ``values``."""
    masked = torch.where(keep, values, 0.0)
    m = keep.to(values.dtype)
    if values.dim() == 2:
        return (masked.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(values)
    index = _rejection.sequence_index(values.shape, cu_seqlens, values.device)
    rows = cu_seqlens.numel() - 1
    sums = masked.new_zeros(rows).index_add(0, index, masked)
    count = m.new_zeros(rows).index_add_(0, index, m).clamp(min=1)
    return (sums / count)[index]


def _through_seq_mean(x: torch.Tensor, keep: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """The values of ``x``, the gradient of each element that of its sequence's kept mean."""
    if not x.requires_grad:
        return x
    mean = _seq_mean(x, keep, cu_seqlens)
    return x.detach() + (mean - mean.detach())


def _count(loss_mask: torch.Tensor) -> torch.Tensor:
    """AReaL's ``loss_mask.count_nonzero() or 1``, without a host sync."""
    return loss_mask.count_nonzero().clamp(min=1)


def ppo_actor_loss_fn(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    rejection_sampling=None,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """AReaL ``ppo_actor_loss_fn`` on the fused ``policy_loss`` (module docstring)."""
    record("areal.ppo_actor_loss_fn")
    _check_level(importance_sampling_level)
    if c_clip is not None and not c_clip > 1.0:
        raise ValueError(f"c_clip: must be > 1.0, got {c_clip}")  # (AReaL asserts it)
    sequence = importance_sampling_level == "sequence"
    cu = _layout(logprobs, cu_seqlens, sequence)
    count = _count(loss_mask)
    weight = rs = None
    if rejection_sampling is not None:
        rs = _rejection.rejection_sampling(proximal_logprobs, old_logprobs, loss_mask, cu_seqlens, rejection_sampling)
        loss_mask, weight = rs.loss_mask, rs.behave_imp_weight
    keep = loss_mask.bool()
    adv = advantages.detach()
    lp = logprobs
    if sequence:
        adv = torch.where(keep, _seq_mean(adv, keep, cu), 0.0)
        lp = _through_seq_mean(logprobs, keep, cu)
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    with caller_names(_NAMES):
        opts = resolve_policy_loss_options(
            "areal",
            loss_type="gspo" if sequence else "ppo",
            clip_low=eps_clip,
            clip_high=high,
            clip_ratio_c=c_clip,
            gspo_dual_clip=sequence and c_clip is not None,
            agg="none",
        )
        tok, _ = _policy_loss(
            lp,
            proximal_logprobs,
            adv if weight is None else adv * weight.to(adv.dtype),
            keep,
            options=opts,
            cu_seqlens=cu,
            backend=current_backend(),
        )
    loss = tok.sum() / count
    with torch.no_grad():
        delta = (logprobs - proximal_logprobs).detach()
        ratio = _seq_mean(delta, keep, cu).exp() if sequence else delta.exp()
        ratio = torch.where(keep, ratio, 0.0)
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
        clip_mask = (pg1 < pg2) & keep
        if c_clip is not None:
            dual_clip_mask = (adv.abs() * c_clip < torch.maximum(pg1, pg2)) & keep
        else:
            dual_clip_mask = torch.zeros_like(clip_mask)
        stat = dict(
            loss=tok.detach(),
            importance_weight=ratio,
            approx_kl=delta,
            clip_mask=clip_mask,
            dual_clip_mask=dual_clip_mask,
        )
        if rs is not None:
            behave_mask = (weight > 0) & keep
            behave_kl = proximal_logprobs.detach() - old_logprobs.detach()
            stat.update(
                behave_approx_kl=torch.where(behave_mask, behave_kl, 0.0),
                behave_imp_weight=weight,
                behave_mask=behave_mask,
                filtered_fraction=rs.filtered_fraction,
            )
    return loss, stat


def sapo_loss_fn(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
    loss_mask: torch.Tensor,
    importance_sampling_level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """AReaL ``sapo_loss_fn`` on the fused ``policy_loss`` (``loss_type="sapo"``): the gate
    σ(τ·(ρ − 1))·4/τ, τ = ``tau_pos`` for A > 0 else ``tau_neg``, against the behaviour
    log-probs (AReaL's SAPO has no proximal policy)."""
    record("areal.sapo_loss_fn")
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos, tau_neg: the SAPO temperatures must be positive, got {tau_pos}, {tau_neg}")
    _check_level(importance_sampling_level)
    sequence = importance_sampling_level == "sequence"
    cu = _layout(logprobs, cu_seqlens, sequence)
    count = _count(loss_mask)
    keep = loss_mask.bool()
    adv = advantages.detach()
    if sequence:
        adv = torch.where(keep, _seq_mean(adv, keep, cu), 0.0)
        # the sequence's mean log-ratio as every token's δ (against 0), its gradient spread
        lp, old = _seq_mean(logprobs - old_logprobs.detach(), keep, cu), torch.zeros_like(old_logprobs)
    else:
        lp, old = logprobs, old_logprobs
    with caller_names(_SAPO_NAMES):
        opts = resolve_policy_loss_options("areal", loss_type="sapo", tau_pos=tau_pos, tau_neg=tau_neg, agg="none")
        tok, _ = _policy_loss(lp, old, adv, keep, options=opts, cu_seqlens=cu, backend=current_backend())
    loss = tok.sum() / count
    with torch.no_grad():
        delta = (logprobs - old_logprobs).detach()
        ratio = torch.where(keep, lp.detach().exp(), 0.0) if sequence else delta.exp()
        gate_pos = torch.sigmoid(tau_pos * (ratio - 1.0)) * (4.0 / tau_pos)
        gate_neg = torch.sigmoid(tau_neg * (ratio - 1.0)) * (4.0 / tau_neg)
        no = torch.zeros_like(loss_mask, dtype=torch.bool)
        stat = dict(
            loss=tok.detach(),
            importance_weight=ratio,
            approx_kl=delta,
            clip_mask=no,
            dual_clip_mask=no.clone(),
            sapo_soft_gate=torch.where(adv > 0, gate_pos, gate_neg),
            sapo_scaled_gate_pos=gate_pos,
            sapo_scaled_gate_neg=gate_neg,
        )
    return loss, stat


def _gather(logits, labels, temperature, tp_group, entropy: bool):
    import torch.distributed as dist

    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        raise NotImplementedError(
            "tp_group: AReaL's vocabulary-parallel log-probs (logits sharded over the tensor-parallel ranks) are "
            "not served by the drop-in"
        )
    with caller_names({"targets": "labels"}):
        res = _logprobs_from_logits(
            logits, labels, temperature=temperature, return_entropy=entropy, backend=current_backend()
        )
    return res.logp.float(), (res.entropy.float() if entropy else None)


def gather_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """AReaL ``gather_logprobs``: the log-probs of ``labels`` under ``logits / temperature``
    (fp32), one fused pass (``chunk_size`` is a memory setting of AReaL's chunked path)."""
    record("areal.gather_logprobs")
    return _gather(logits, labels, temperature, tp_group, entropy=False)[0]


def gather_logprobs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL ``gather_logprobs_entropy``: (log-probs, entropies), fp32, one fused pass."""
    record("areal.gather_logprobs_entropy")
    return _gather(logits, labels, temperature, tp_group, entropy=True)
