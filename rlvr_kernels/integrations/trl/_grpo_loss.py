"""The pieces of :func:`~rlvr_kernels.integrations.trl.grpo_trainer.grpo_loss_trl` (TRL's
``GRPOTrainer._compute_loss`` as one fused ``policy_loss`` call): TRL's settings as the
op's options (:func:`make_plan`), the checked inputs (:func:`check_inputs`), the op call
with the per-sequence torch terms (:func:`fused_loss`) and TRL's entropy bonus
(:func:`entropy_bonus`). The lean-torch terms (TRL's normalisers, its k3, its entropy
bonus) are the integrations' one implementation, ``integrations._torch_math``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ..._core.validation import (
    FLOAT_DTYPES,
    MASK_DTYPES,
    check_int,
    check_like,
    check_number,
    check_tensor,
    checks_enabled,
)
from ...ops.policy_loss import policy_loss
from ...options import TokenShaping, resolve_policy_loss_options
from .._torch_math import aggregate, kl_estimate

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# GSPO's log s_i clamp (10 in verl) is off for TRL: a bound no finite mean log-ratio reaches.
_NO_GSPO_CLAMP = 1e30
# Off-policy / zero-ratio tokens are dropped through the op's token_mis weight (see _keep_logprobs):
# a kept token's rollout log-prob is its old one (weight exactly 1, inside [1/C, C]); a dropped
# token's is 40 below (the clamped weight e^20 > C: weight exactly 0).
_MIS_CAP = 2.0
_DROP_GAP = 40.0


@dataclass(frozen=True)
class LossPlan:
    """What a call's TRL settings ask of ``policy_loss``: its option fields, aggregation
    keywords, the divisor applied after it, and what the call needs from its tensors."""

    fields: Dict[str, Any]  # resolve_policy_loss_options fields
    loss_type: str = "dapo"
    agg_kw: Dict[str, Any] = field(default_factory=dict)  # global_num_tokens / _seqs, loss_scale_factor
    post: float = 1.0  # TRL's accumulation divisor, after the op
    seq_level: bool = False
    shaping: Optional[TokenShaping] = None
    top_q: float = 1.0
    process_group: Any = None
    beta: float = 0.0
    bias_kl: bool = False  # use_bias_correction_kl with beta != 0
    entropy_coef: float = 0.0
    accum: float = 1.0  # the entropy bonus's accumulation divisor
    eps_high: float = 0.2
    high_never: bool = False  # delta <= 1 + ε_high: TRL's min(ρ, δ) never exceeds 1 + ε_high
    tau: Tuple[float, float] = (1.0, 1.05)
    vespo: Tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)
    opsm: Optional[float] = None
    num_processes: int = 1


def make_plan(logps, **c) -> LossPlan:
    """TRL's settings -> ``policy_loss`` options, checked first (each error names the
    setting), in the order ``_compute_loss`` reads them. ``logps`` gives B only."""
    loss_type = c["loss_type"]
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of TRL's {TRL_LOSS_TYPES}, got {loss_type!r}")
    level = c["importance_sampling_level"]
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level: expected 'token' or 'sequence', got {level!r}")
    opsm = c["off_policy_mask_threshold"]
    if opsm is not None:
        opsm = check_number("off_policy_mask_threshold", opsm)
    eps_low = check_number("epsilon_low", c["epsilon_low"])
    eps_high = eps_low if c["epsilon_high"] is None else check_number("epsilon_high", c["epsilon_high"])
    beta = check_number("beta", c["beta"])
    top_q = check_number("top_entropy_quantile", c["top_entropy_quantile"], minimum=0.0, maximum=1.0, open_low=True)
    entropy_coef = check_number("entropy_coef", c["entropy_coef"])
    accum_steps = check_int("gradient_accumulation_steps", c["gradient_accumulation_steps"], minimum=1)
    num_processes = check_int("num_processes", c["num_processes"], minimum=1)
    spg = check_int("steps_per_generation", c["steps_per_generation"], minimum=1)
    vespo = tuple(check_number(n, v) for n, v in zip(_VESPO_NAMES, c["vespo"]))
    seq_level = level == "sequence"
    accum = float(accum_steps) if c["training"] else 1.0

    fields, high_never = _loss_fields(loss_type, eps_low, eps_high, c["delta"], seq_level, c)
    if not isinstance(c["use_bias_correction_kl"], bool):
        raise TypeError(f"use_bias_correction_kl: expected a bool, got {type(c['use_bias_correction_kl']).__name__}")
    bias_kl = beta != 0.0 and c["use_bias_correction_kl"]
    if beta != 0.0 and not (bias_kl and seq_level):  # (sequence level: the torch term, see grpo_loss_trl)
        fields.update(kl="k3", kl_coef=beta, kl_ratio_correction=bias_kl)
    shaping = None
    if top_q < 1.0:
        if num_processes > 1 and c["process_group"] is None and c["entropy_threshold"] is None:
            raise NotImplementedError(
                "top_entropy_quantile: with num_processes > 1 TRL's threshold is the quantile over all "
                "processes' tokens; pass process_group= (a torch.distributed group) or entropy_threshold="
            )
        shaping = TokenShaping(entropy_quantile=top_q)
        fields["shaping"] = shaping
    elif c["entropy_threshold"] is not None:
        raise ValueError("entropy_threshold: only used with top_entropy_quantile < 1")

    B = logps.shape[0] if isinstance(logps, torch.Tensor) and logps.dim() else 0
    agg_kw, post = _aggregation(loss_type, fields, B, accum, num_processes, spg, c)
    return LossPlan(
        fields=fields,
        loss_type=loss_type,
        agg_kw=agg_kw,
        post=post,
        seq_level=seq_level,
        shaping=shaping,
        top_q=top_q,
        process_group=c["process_group"],
        beta=beta,
        bias_kl=bias_kl,
        entropy_coef=entropy_coef,
        accum=accum,
        eps_high=eps_high,
        high_never=high_never,
        tau=(check_number("sapo_temperature_pos", c["sapo_temperature_pos"]), c["sapo_temperature_neg"]),
        vespo=vespo,
        opsm=opsm,
        num_processes=num_processes,
    )


_VESPO_NAMES = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


def _loss_fields(loss_type, eps_low, eps_high, delta, seq_level, c) -> Tuple[Dict[str, Any], bool]:
    """The loss type's options (the clip family, CISPO, SAPO, or REINFORCE for what a
    per-sequence weight turns into it), and whether TRL never sees the high clip side."""
    if loss_type in CLIPPED:
        fields = dict(loss_type="gspo" if seq_level else "ppo", clip_low=eps_low, clip_high=eps_high)
        high_never = False
        if delta is not None:
            delta = check_number("delta", delta)
            if delta > 1 + eps_high:
                fields["clip_ratio_c"] = delta
            else:
                if delta < 1 or not eps_high > 0:
                    raise NotImplementedError(
                        f"delta: fused for delta > 1 + epsilon_high, or 1 <= delta <= 1 + epsilon_high with "
                        f"epsilon_high > 0; got delta={delta}, epsilon_high={eps_high}"
                    )
                # A > 0: the upper clip bound becomes δ; A < 0: c = 1 + ε_high caps the ratio.
                fields.update(clip_high=delta - 1.0, clip_ratio_c=1.0 + eps_high)
                high_never = True
            fields["gspo_dual_clip"] = seq_level
        if seq_level:
            fields["gspo_log_clamp"] = _NO_GSPO_CLAMP
        return fields, high_never
    if loss_type == "cispo":
        if seq_level or eps_high < 1:  # the detached clamped ratio as a weight (see fused_loss)
            return dict(loss_type="reinforce"), False
        return dict(loss_type="cispo", clip_low=1.0, clip_high=eps_high - 1.0), False
    if loss_type == "vespo":
        return dict(loss_type="reinforce"), False
    check_number("sapo_temperature_pos", c["sapo_temperature_pos"])
    tau_neg = check_number("sapo_temperature_neg", c["sapo_temperature_neg"])
    if seq_level:  # the pg term in torch (see fused_loss); the op gives KL and metrics
        return dict(loss_type="reinforce"), False
    return dict(loss_type="sapo", tau_pos=c["sapo_temperature_pos"], tau_neg=tau_neg), False


def _aggregation(loss_type, fields, B, accum, num_processes, spg, c) -> Tuple[Dict[str, Any], float]:
    """TRL's normaliser per loss type: the op's aggregation (set in ``fields``), its
    keywords, and the divisor applied to the op's loss."""
    if loss_type in ("grpo", "sapo"):
        fields["agg"] = "seq-mean-token-mean"
        return dict(global_num_seqs=B), accum
    if loss_type == "bnpo":
        fields["agg"] = "token-mean"
        return {}, accum
    if loss_type == "dr_grpo":
        if c["max_completion_length"] is None:
            raise ValueError("max_completion_length: loss_type='dr_grpo' divides by B · max_completion_length")
        length = check_int("max_completion_length", c["max_completion_length"], minimum=1)
        fields["agg"] = "seq-mean-token-sum-norm"
        return dict(global_num_seqs=B, loss_scale_factor=length), accum
    if loss_type == "luspo":
        fields["agg"] = "seq-mean-token-sum"
        return dict(global_num_seqs=B), accum
    # dapo, cispo, vespo
    items = c["num_items_in_batch"]
    if items is None:
        raise ValueError(f"num_items_in_batch: loss_type={loss_type!r} normalises by it")
    if isinstance(items, torch.Tensor):
        if items.numel() != 1:
            raise ValueError(f"num_items_in_batch: expected a number or a one-element tensor, got {tuple(items.shape)}")
        normalizer = items.clamp(min=1.0) / num_processes
    else:
        normalizer = max(check_number("num_items_in_batch", items), 1.0) / num_processes
    if c["training"]:
        normalizer = normalizer * c["gradient_accumulation_steps"] / spg
    fields["agg"] = "token-mean"
    return dict(global_num_tokens=normalizer), 1.0


@dataclass(frozen=True)
class LossInputs:
    """The call's tensors, checked, as the op takes them."""

    logps: torch.Tensor
    old: torch.Tensor
    raw_adv: torch.Tensor  # TRL's advantages, [B, 1] or [B, T] (what its metrics read)
    advantages: torch.Tensor  # [B] or [B, T] for the op, non-zero IS ratios folded in
    mask: torch.Tensor
    ref: Optional[torch.Tensor]
    entropies: Optional[torch.Tensor]
    is_ratio: Optional[torch.Tensor]  # TRL's importance_sampling_ratio (vespo's gamma weights read it)
    pg_ratio: Optional[torch.Tensor]  # the ratio when it multiplies the pg term (folded into advantages)
    keep: Optional[torch.Tensor]  # [B, T] bool: tokens whose pg term stays (off-policy mask, ratio != 0)
    threshold: Optional[torch.Tensor]  # the entropy threshold (0-d fp32), with top_entropy_quantile < 1


def check_inputs(
    logps, old, advantages, mask, ref, entropies, ratio, apply_ratio, sampling, threshold, plan: LossPlan, validate
) -> LossInputs:
    """Shapes, devices and dtypes first (each error names TRL's argument), then values.
    The tensors only this wrapper reads are checked here; the op checks the others (its
    errors renamed to TRL's names). (Long for the checks of every optional tensor.)"""
    check_tensor("per_token_logps", logps, dtypes=FLOAT_DTYPES, ndim=(2,))
    check_like("completion_mask", mask, logps, "per_token_logps", dtypes=MASK_DTYPES)
    shape = tuple(logps.shape)
    B = shape[0]
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES, like=logps, like_name="per_token_logps")
    if tuple(advantages.shape) not in ((B,), (B, 1), shape):
        raise ValueError(
            f"advantages: expected [B] = {(B,)}, [B, 1] = {(B, 1)} or [B, T] = {shape}, got {tuple(advantages.shape)}"
        )
    if ratio is not None:
        check_tensor("importance_sampling_ratio", ratio, dtypes=FLOAT_DTYPES, like=logps, like_name="per_token_logps")
        if tuple(ratio.shape) not in ((B,), (B, 1), shape):
            raise ValueError(
                f"importance_sampling_ratio: expected [B, T] = {shape} or [B, 1] = {(B, 1)} (or [B]), "
                f"got {tuple(ratio.shape)}"
            )
    if sampling is not None:
        check_like("sampling_per_token_logps", sampling, logps, "per_token_logps", dtypes=FLOAT_DTYPES)
    if plan.beta != 0.0 and ref is None:
        raise ValueError("ref_per_token_logps: beta != 0 needs the reference log-probs")
    if entropies is None:
        if plan.shaping is not None:
            raise ValueError("entropies: top_entropy_quantile < 1 needs the per-token entropies")
        if plan.entropy_coef != 0.0:
            raise ValueError("entropies: entropy_coef != 0 needs the per-token entropies")
    if threshold is not None:
        check_tensor("entropy_threshold", threshold, dtypes=FLOAT_DTYPES, like=logps, like_name="per_token_logps")
        if threshold.numel() != 1:
            raise ValueError(f"entropy_threshold: expected one element, got shape {tuple(threshold.shape)}")

    old = logps.detach() if old is None else old
    raw_adv = advantages if advantages.dim() == 2 else advantages[:, None]  # TRL's unsqueeze(1)
    adv = raw_adv[:, 0] if raw_adv.shape[1] == 1 and raw_adv.shape != logps.shape else raw_adv
    r = None if ratio is None else (ratio if ratio.dim() == 2 else ratio[:, None]).detach()
    zeros = True  # whether the ratio may hold zeros (they need the keep mask); known when checked
    if r is not None and checks_enabled(validate, r, mask) and r.numel():
        valid = (mask != 0) if r.shape == logps.shape else (mask != 0).any(-1).reshape(r.shape)
        negative, zeros = torch.stack([(~(r >= 0) & valid).any(), (r == 0).any()]).tolist()  # one host sync
        if negative:
            raise ValueError(
                "importance_sampling_ratio: expected ratios >= 0 on valid tokens (the fold into the "
                "advantages is exact for non-negative ratios only)"
            )
    keep = None
    if plan.opsm is not None:
        keep = _off_policy_mask(raw_adv, logps, old if sampling is None else sampling, mask, plan.opsm)
    use_ratio = r is not None and apply_ratio and plan.loss_type != "vespo"
    if use_ratio and zeros:
        nonzero = r != 0
        keep = nonzero if keep is None else keep & nonzero
        adv = _fold_ratio(adv, torch.where(nonzero, r, torch.ones_like(r)), shape)
    elif use_ratio:  # (truncate modes: no zero, a plain fold)
        adv = _fold_ratio(adv, r, shape)
    if keep is not None:
        keep = keep.expand(shape)
    return LossInputs(
        logps=logps,
        old=old,
        raw_adv=raw_adv,
        advantages=adv,
        mask=mask,
        ref=ref if plan.beta != 0.0 else None,
        entropies=entropies,
        is_ratio=r,
        pg_ratio=r if use_ratio else None,
        keep=keep,
        threshold=None if threshold is None else threshold.detach().reshape(()).float(),
    )


def _fold_ratio(adv: torch.Tensor, r: torch.Tensor, shape) -> torch.Tensor:
    """A · ratio, with TRL's broadcasting (``r`` [B, 1] per sequence or [B, T] per token)."""
    if r.shape[1] == 1 and tuple(r.shape) != tuple(shape):
        return (adv * r[:, 0]) if adv.dim() == 1 else adv * r
    return (adv[:, None] if adv.dim() == 1 else adv) * r


@torch.no_grad()
def _off_policy_mask(advantages, logps, sampling, mask, threshold) -> torch.Tensor:
    """TRL's ``GRPOTrainer.get_off_policy_mask`` (DeepSeek-V3.2's off-policy sequence mask),
    as a bool keep flag: [B, 1] (or [B, T] for token advantages)."""
    kl_div = torch.nan_to_num(sampling - logps.detach(), nan=0.0)
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return (advantages >= 0) | (avg_seq_kl <= threshold)


@torch.no_grad()
def _gamma_weights(x: LossInputs, plan: LossPlan) -> torch.Tensor:
    """TRL's ``GRPOTrainer.get_gamma_weights`` (VESPO): φ(w) = e^λ·w^k·e^{−λw} per sequence,
    [B, 1], detached; w the sequence ratio Σ clamp(δ)·m plus the summed log IS ratio."""
    k_pos, lambda_pos, k_neg, lambda_neg = plan.vespo
    lower_clamp = math.log(1e-8)
    log_ratio = torch.clamp(x.logps.detach() - x.old, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio * x.mask, dim=-1, keepdim=True)
    if x.is_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(x.is_ratio), lower_clamp, 20.0)
        seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = x.raw_adv >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _seq_log_ratio(x: LossInputs) -> torch.Tensor:
    """TRL's sequence-level log importance weight (Σ δ·m / max(n, 1)), [B, 1], differentiable."""
    log_ratio = x.logps - x.old
    return ((log_ratio * x.mask).sum(-1) / x.mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def fused_loss(x: LossInputs, plan: LossPlan, validate, backend):
    """The op call (two at sequence level with a pg multiplier that varies inside a
    sequence and a plain KL term), the per-sequence pre-computations and the torch terms
    (see grpo_loss_trl's mapping). Returns (loss before TRL's accumulation divisor,
    metrics, the extra values TRL's metrics read). (Long: one branch per TRL option that
    is not a plain op option.)"""
    fields = dict(plan.fields)
    adv = x.advantages
    extra: Dict[str, torch.Tensor] = {}
    torch_terms = []  # (per-token term [B, T] (or [B, 1]), name of the metric it replaces)
    seq_lr = _seq_log_ratio(x) if plan.seq_level else None
    if plan.loss_type == "vespo":
        phi = _gamma_weights(x, plan)
        extra["phi"] = phi
        adv = _fold_ratio(adv, phi, x.logps.shape)
    elif plan.loss_type == "cispo" and fields["loss_type"] == "reinforce":
        coef_1 = torch.exp(seq_lr.detach() if plan.seq_level else x.logps.detach() - x.old)
        extra["cispo_clipped"] = (coef_1 > plan.eps_high) & (x.raw_adv > 0)
        adv = _fold_ratio(adv, torch.clamp(coef_1, max=plan.eps_high), x.logps.shape)
    elif plan.loss_type == "sapo" and plan.seq_level:
        coef_1 = torch.exp(seq_lr)
        tau_pos, tau_neg = plan.tau
        temperatures = torch.where(x.raw_adv > 0, tau_pos, tau_neg)
        pg = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * x.raw_adv
        for m in _pg_masks(x):
            pg = pg * m
        torch_terms.append((pg, "pg_loss"))
        adv = torch.zeros_like(adv)
    if plan.bias_kl and plan.seq_level:
        ref, lp = x.ref, x.logps
        per_token_kl = kl_estimate(lp, ref, "k3", clamp=False) * torch.exp(seq_lr)
        extra["kl"] = per_token_kl
        torch_terms.append((plan.beta * per_token_kl, "kl_loss"))

    # Sequence level with a pg multiplier that varies inside a sequence (token advantages,
    # a token IS ratio or mask, the entropy mask): TRL's gradient reaches every token through
    # the sequence mean, so it is the token form's gradient averaged over the sequence's tokens.
    # (Only the clipped family: cispo's and vespo's sequence weights are detached, sapo's
    # term is the torch one.)
    spread = plan.seq_level and plan.loss_type in CLIPPED
    spread = spread and (adv.dim() == 2 or plan.shaping is not None or x.keep is not None)
    split_kl = spread and "kl" in fields  # the KL gradient stays per token: its own call
    if split_kl:
        kl_fields = {k: v for k, v in fields.items() if k in ("agg", "kl", "kl_coef")}
        kl_opts = resolve_policy_loss_options("trl", loss_type="reinforce", **kl_fields)
        fields.pop("kl"), fields.pop("kl_coef"), fields.pop("kl_ratio_correction")
    roll = None
    if x.keep is not None:
        fields.update(rollout_correction="token_mis", rollout_threshold=_MIS_CAP)
        roll = _keep_logprobs(x.old, x.keep)
    opts = resolve_policy_loss_options("trl", **fields)
    logps = _SequenceMeanGrad.apply(x.logps, x.mask) if spread else x.logps
    loss, metrics = policy_loss(
        logps,
        x.old,
        adv,
        x.mask,
        options=opts,
        ref_logprobs=x.ref if "kl" in fields else None,
        rollout_logprobs=roll,
        entropy=x.entropies,
        entropy_threshold=x.threshold,
        validate=validate,
        backend=backend,
        **plan.agg_kw,
    )
    if split_kl:
        zeros = torch.zeros(x.logps.shape[0], dtype=torch.float32, device=x.logps.device)
        kl_loss, kl_metrics = policy_loss(
            x.logps,
            x.old,
            zeros,
            x.mask,
            options=kl_opts,
            ref_logprobs=x.ref,
            validate=validate,
            backend=backend,
            **plan.agg_kw,
        )
        loss = loss + kl_loss
        metrics = metrics._replace(kl_loss=kl_metrics.kl_loss, kl=kl_metrics.kl)
    for term, name in torch_terms:
        agg = _trl_aggregate(term, x.mask, plan)
        loss = loss + agg
        value = agg.detach().float()
        if name == "kl_loss":
            kl_mean = aggregate(extra["kl"], (x.mask != 0).to(term.dtype), "token-mean", convention="trl")
            metrics = metrics._replace(kl_loss=value / plan.beta, kl=kl_mean.detach().float())
        else:
            metrics = metrics._replace(pg_loss=value)
    return loss, metrics, extra


def _pg_masks(x: LossInputs):
    """The multipliers TRL applies to its pg term after the loss type (for a torch pg term):
    the off-policy mask, the entropy mask, the IS ratio (folded / kept as the op gets them)."""
    out = []
    if x.threshold is not None:
        out.append(((x.entropies.detach().float() >= x.threshold) & (x.mask != 0)).to(x.logps.dtype))
    if x.keep is not None:
        out.append(x.keep.to(x.logps.dtype))
    if x.pg_ratio is not None:
        out.append(x.pg_ratio.to(x.logps.dtype))
    return out


def _keep_logprobs(old: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Rollout log-probs for the op's token_mis weight that keep exactly the ``keep`` tokens:
    the old log-prob (weight e^0 = 1 inside [1/C, C]) or 40 below it (e^20 > C: weight 0)."""
    old = old.detach()
    return torch.where(keep, old, old - _DROP_GAP)


def _trl_aggregate(per_token: torch.Tensor, mask: torch.Tensor, plan: LossPlan) -> torch.Tensor:
    """TRL's normaliser of ``_compute_loss`` for the loss type, on a torch per-token term
    (broadcast to [B, T]); before the accumulation divisor (plan.post), as the op's loss."""
    return aggregate(
        per_token,
        mask,
        plan.fields["agg"],  # the loss type's mode (see _aggregation)
        global_num_tokens=plan.agg_kw.get("global_num_tokens"),
        loss_scale_factor=plan.agg_kw.get("loss_scale_factor"),
        convention="trl",
    )


def entropy_bonus(entropies, mask, threshold, plan: LossPlan) -> torch.Tensor:
    """TRL's entropy bonus: Σ H·m / max(Σ m, 1) / accumulation over the (entropy-masked)
    completion tokens, whatever the loss type's normaliser (gradient to ``entropies``)."""
    eff = mask != 0
    if threshold is not None:
        eff = eff & (entropies.detach().float() >= threshold)
    return aggregate(entropies, eff.to(entropies.dtype), "token-mean", convention="trl") / plan.accum


class _SequenceMeanGrad(torch.autograd.Function):
    """Identity forward; backward replaces each valid token's gradient by its sequence's
    mean (over valid tokens) — the chain rule through TRL's sequence-level log-ratio mean."""

    @staticmethod
    def forward(ctx, logps, mask):
        ctx.save_for_backward(mask)
        return logps.view_as(logps)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        m = (mask != 0).to(grad.dtype)
        per_seq = (grad * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        return per_seq * m, None
