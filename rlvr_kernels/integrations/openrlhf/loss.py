"""Drop-in for ``openrlhf.models.loss``: ``PolicyLoss`` (the ``nn.Module``, OpenRLHF 0.11.2's
constructor and ``forward``) as one fused ``policy_loss`` call with ``preset="openrlhf"``.

OpenRLHF's ``PolicyLoss.forward`` returns ``(loss, clip_ratio, ppo_kl, vllm_kl,
is_filter_ratio)``; the last two are None unless an importance-sampling correction is on
with ``policy_loss_type="ppo"``. How its options map onto the op (docs/integrations-openrlhf.md):

- ``policy_loss_type``: ``"ppo"`` (δ clamped to ±20) or ``"gspo"`` (the sequence ratio,
  always the per-sample mean); ``dual_clip`` is ``clip_ratio_c``;
- ``token_level_loss``: ``agg="token-mean"`` or ``"seq-mean-token-mean"``, with
  ``batch_num_tokens`` / ``global_batch_size`` / ``dp_size`` as the op's global counts;
- ``is_correction_*``: :meth:`rlvr_kernels.RolloutCorrection.from_openrlhf` (the weight is
  0 where OpenRLHF's gate drops a token or a sequence; the token stays counted). For
  ``"gspo"`` OpenRLHF weights nothing and forms the ratio against the rollout log-probs:
  the op gets them as its ``old_logprobs``, without a correction.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ...ops.policy_loss import policy_loss as _policy_loss
from ...ops.policy_loss import rollout_correction as _rollout_correction
from ...options import RolloutCorrection
from .._backend import current_backend
from .._errors import caller_names
from .._patch import record

__all__ = ["PolicyLoss"]

POLICY_LOSS_TYPES = ("ppo", "gspo")
# the op's argument names -> OpenRLHF's
_NAMES = {
    "logprobs": "log_probs",
    "old_logprobs": "old_log_probs",
    "rollout_logprobs": "rollout_log_probs",
    "mask": "action_mask",
    "global_num_tokens": "batch_num_tokens",
    "global_num_seqs": "global_batch_size",
    "clip_ratio_c": "dual_clip",
}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's ``masked_mean`` over every element (NaN for an empty mask, as there)."""
    return (x * mask).sum() / mask.sum()


def _through_row_mean(log_probs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """The same values, with the gradient of each row's masked mean spread over its valid tokens.

    OpenRLHF's GSPO term of token t is f_t(s_i), s_i = exp(mean_t δ) of its row, so the
    gradient of log-prob k is Σ_t f_t'(s_i)·s_i / n_i: the mean of the per-token terms'
    gradients. The op attributes each token's term to its own log-prob (f_k'(s_i)·s_i, verl's
    form); the two agree when the advantage is constant along a row and differ when it varies
    (OpenRLHF's per-token returns with a KL reward). Feeding the op sg(x) + (x̄ − sg(x̄)), x̄ the
    row's masked mean, turns its gradient into the row mean of it, OpenRLHF's."""
    m = action_mask.to(log_probs.dtype)
    mean = (log_probs * m).sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp(min=1)
    return log_probs.detach() + (mean - mean.detach())


class PolicyLoss(nn.Module):
    """OpenRLHF ``models.loss.PolicyLoss`` on the fused ``policy_loss`` (module docstring).
    Its constructor checks, raised as ValueError naming the argument; a ``policy_loss_type``
    other than ``"ppo"`` / ``"gspo"`` raises at construction (OpenRLHF raises at the first
    ``forward``)."""

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: list = (0.5, 5.0),
    ) -> None:
        super().__init__()
        record("openrlhf.PolicyLoss.__init__")
        if policy_loss_type not in POLICY_LOSS_TYPES:
            raise ValueError(f"policy_loss_type: expected one of {POLICY_LOSS_TYPES}, got {policy_loss_type!r}")
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip: must be > 1.0, got {dual_clip}")
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.dual_clip = dual_clip
        self.policy_loss_type = policy_loss_type
        # OpenRLHF's GSPO is the per-sample mean whatever token_level_loss says.
        self.token_level_loss = token_level_loss if policy_loss_type == "ppo" else False
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold
        threshold = tuple(is_correction_threshold)
        # OpenRLHF's constructor reads (LOW, HIGH); its CLI turns a single HIGH into (0, HIGH).
        self._correction: Optional[RolloutCorrection] = RolloutCorrection.from_openrlhf(
            is_correction_level, is_correction_mode, is_correction_gating, threshold
        )

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ) -> torch.Tensor:
        record("openrlhf.PolicyLoss")
        if action_mask is None:
            raise ValueError("action_mask: OpenRLHF's PolicyLoss needs the [B, T] action mask (it aggregates over it)")
        rc = self._correction
        if rc is not None and rollout_log_probs is None:
            raise ValueError(
                f"rollout_log_probs: is_correction_level={self.is_correction_level!r} needs the rollout log-probs"
            )
        gspo = self.policy_loss_type == "gspo"
        # GSPO under a correction: the sequence ratio against the rollout policy, no weight.
        old = rollout_log_probs if (gspo and rc is not None) else old_log_probs
        if gspo and log_probs.requires_grad:
            log_probs = _through_row_mean(log_probs, action_mask)
        token_level = self.token_level_loss
        total = batch_num_tokens if token_level else global_batch_size
        with caller_names(_NAMES):
            loss, met = _policy_loss(
                log_probs,
                old,
                advantages,
                action_mask,
                preset="openrlhf",
                loss_type=self.policy_loss_type,
                clip_low=float(self.clip_eps_low),
                clip_high=float(self.clip_eps_high),
                clip_ratio_c=self.dual_clip,
                agg="token-mean" if token_level else "seq-mean-token-mean",
                rollout_correction=None if gspo else rc,
                rollout_logprobs=None if (gspo or rc is None) else rollout_log_probs,
                global_num_tokens=batch_num_tokens if token_level else None,
                global_num_seqs=None if token_level else global_batch_size,
                # OpenRLHF's dp_size multiplies only the loss normalised by a global total
                dp_size=int(dp_size) if total is not None else 1,
                backend=current_backend(),
            )
        mask = action_mask.to(torch.float32)
        # OpenRLHF's ppo_kl: of the unclamped δ, against old_log_probs whatever the ratio was
        # formed with (the op's metric is of δ after its ±20 clamp).
        ppo_kl = _masked_mean(-(log_probs.detach().float() - old_log_probs.float()), mask)
        vllm_kl = is_filter_ratio = None
        if rc is not None and not gspo:
            vllm_kl = _masked_mean(rollout_log_probs.float() - old_log_probs.float(), mask)
            if rc.is_level == "sequence":
                is_filter_ratio = self._seq_filter_ratio(old_log_probs, rollout_log_probs, action_mask)
            else:
                is_filter_ratio = met.is_masked_frac
        return loss, met.pg_clipfrac, ppo_kl, vllm_kl, is_filter_ratio

    def _seq_filter_ratio(self, old_log_probs, rollout_log_probs, action_mask) -> torch.Tensor:
        """OpenRLHF's sequence-level ``is_filter_ratio``: the fraction of the B rows the gate
        drops (a row without an action token counts as dropped, as OpenRLHF's 0/0 does). A
        kept sequence's weights are exp(x) > 0 on its valid tokens, a dropped one's 0."""
        with caller_names(_NAMES):
            w, _, _ = _rollout_correction(
                self._correction, old_log_probs.detach(), rollout_log_probs, action_mask, backend=current_backend()
            )
        kept = ((w > 0) & action_mask.bool()).any(dim=-1)
        return (~kept).float().mean()
