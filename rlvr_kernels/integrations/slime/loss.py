"""slime's policy loss for ``--loss-type custom_loss --custom-loss-function-path``.

slime's ``loss_function`` (``slime/backends/megatron_utils/loss.py``) calls the custom loss
as ``func(args, batch, logits, sum_of_sample_mean)`` and expects ``(loss, metrics)``, the
loss before its micro-batch / data-parallel rescaling. :func:`policy_loss_function`
reproduces slime's ``policy_loss_function`` on the fused ops: the log-probs and entropies
of the response tokens from the logits in one :func:`rlvr_kernels.logprobs_from_logits`
pass, the per-token loss from one :func:`rlvr_kernels.policy_loss` call (``agg="none"``),
reduced by the ``sum_of_sample_mean`` slime passes.

The logits slime passes are Megatron's output ``[1, T, V]``, vocab-parallel under tensor
parallelism: only ``tensor_model_parallel_size = 1`` (the whole vocabulary on the rank) is
accepted. A logit-free path (log-probs from the hidden states and the LM head,
:func:`rlvr_kernels.linear_logprobs`) would need the hook to receive the hidden states and
Megatron's vocab-parallel head, which slime's signature does not give.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Tuple

import torch

from ...ops.logprobs import logprobs_from_logits
from ...ops.policy_loss import policy_loss
from ...options import RolloutCorrection, resolve_policy_loss_options
from .._backend import current_backend
from .hooks import _arg, _sample_mean_reducer
from .tis import icepop_function, vanilla_tis_function
from .tis import tis_metrics as _tis_metrics

# slime's --kl-loss-type -> (our estimator, kl_clamp): low_var_kl is k3 with its value
# clamped to ±10 (the preset's clamp), slime's k3 is unclamped, k1 / k2 never clamped.
_KL = {"k1": ("k1", None), "k2": ("k2", None), "k3": ("k3", False), "low_var_kl": ("k3", None)}
_OURS_TIS = {vanilla_tis_function: "clamp", icepop_function: "gate"}


def _load_function(path: str) -> Callable:
    """slime's ``load_function``: ``module.attr``."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _refuse(args: Any) -> None:
    """The slime options this hook does not reproduce: each raises, naming it."""
    checks = (
        ("context_parallel_size", int(getattr(args, "context_parallel_size", 1) or 1) != 1, "context parallelism"),
        (
            "tensor_model_parallel_size",
            int(getattr(args, "tensor_model_parallel_size", 1) or 1) != 1,
            "vocab-parallel logits (each rank holds a slice of the vocabulary)",
        ),
        ("allgather_cp", bool(getattr(args, "allgather_cp", False)), "all-gather context parallelism"),
        ("rollout_top_p", float(getattr(args, "rollout_top_p", 1.0)) != 1.0, "rollout top-p replay"),
        ("use_opsm", bool(getattr(args, "use_opsm", False)), "off-policy sequence masking"),
    )
    for name, bad, what in checks:
        if bad:
            raise ValueError(f"args.{name}: {what} is not supported by this loss (got {getattr(args, name)!r})")
    if _arg(args, "advantage_estimator") == "gspo":
        # GSPO's token form has slime's gradient when every token of a sample carries the
        # same advantage and weight; an IS weight per token, an unbiased KL ratio per token
        # and the distillation penalty break that.
        for name in ("use_tis", "get_mismatch_metrics", "use_unbiased_kl", "use_opd"):
            if bool(getattr(args, name, False)):
                raise ValueError(f"args.{name}: not supported with advantage_estimator='gspo' by this loss")


def _response_index(total_lengths: List[int], response_lengths: List[int], device) -> Tuple[torch.Tensor, list]:
    """Rows of the packed logits that predict each response token (slime's cp = 1 slicing:
    ``logits[end − response − 1 : end − 1]``), in sample order, and the response lengths."""
    idx, end = [], 0
    for i, (total, resp) in enumerate(zip(total_lengths, response_lengths)):
        if not 0 <= int(resp) < int(total):
            raise ValueError(
                f"batch['response_lengths'][{i}]: {resp} with total length {total} (a response needs a prompt token "
                "before it)"
            )
        end += int(total)
        idx.append(torch.arange(end - int(resp) - 1, end - 1))
    rows = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
    return rows.to(device), [int(r) for r in response_lengths]


def _log_probs_and_entropy(args, batch, logits: torch.Tensor, with_entropy_grad: bool):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[0] != 1:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected Megatron's packed [1, T, V], got {got}")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits: slime passes fp32 logits, got {logits.dtype}")
    total_lengths, response_lengths = batch["total_lengths"], batch["response_lengths"]
    tokens = batch["unconcat_tokens"]
    if not (len(tokens) == len(total_lengths) == len(response_lengths)):
        raise ValueError("batch: unconcat_tokens, total_lengths and response_lengths must have one entry per sample")
    x = logits[0]
    T = x.shape[0]
    if sum(int(n) for n in total_lengths) > T:
        raise ValueError(f"batch['total_lengths']: {sum(total_lengths)} tokens, more than the logits' {T} rows")
    rows, sizes = _response_index(total_lengths, response_lengths, x.device)
    # The targets: each response token at the row that predicts it, ignore_index elsewhere
    # (no log-prob, no gradient); one pass over the logits as slime's full-[T, V] call.
    targets = torch.full((T,), -100, dtype=torch.long, device=x.device)
    if sizes:
        resp = torch.cat([t[len(t) - n :] for t, n in zip(tokens, sizes)]).to(device=x.device, dtype=torch.long)
        targets[rows] = resp
    out = logprobs_from_logits(
        x,
        targets,
        float(getattr(args, "rollout_temperature", 1.0)),
        return_entropy=True,
        backend=current_backend(),
    )
    entropy = out.entropy[rows]
    return out.logp[rows], entropy if with_entropy_grad else entropy.detach(), sizes


def _clipfrac(estimator: str, ratio, adv, low: float, high: float) -> torch.Tensor:
    """slime's per-token clip flags: ppo / gspo gt(−A·clip(ρ), −A·ρ), cispo clip(ρ) != ρ."""
    clipped = ratio.clamp(1 - low, 1 + high)
    if estimator == "cispo":
        return (clipped != ratio).float()
    return torch.gt(-clipped * adv, -ratio * adv).float()


def _kl_values(kl_loss_type: str, logp, ref, importance_ratio) -> torch.Tensor:
    """slime's ``compute_approx_kl`` per token, for the reported ``kl_loss`` (detached)."""
    x = logp.float() - ref.float()
    if kl_loss_type == "k1":
        kl = x
    elif kl_loss_type == "k2":
        kl = x.square() / 2
    else:
        kl = torch.expm1(-x) + x
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(-10, 10) if kl_loss_type == "low_var_kl" else kl


def policy_loss_function(
    args: Any,
    batch: Dict[str, Any],
    logits: torch.Tensor,
    sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """slime's ``policy_loss_function`` (PPO clip with ``eps_clip`` / ``eps_clip_high``, dual
    clip ``eps_clip_c``, GSPO, CISPO, TIS, the KL loss, the entropy bonus), returning
    ``(loss, metrics)`` with slime's metric names: ``loss``, ``pg_loss``, ``entropy_loss``,
    ``pg_clipfrac``, ``ppo_kl``, and when their features are on
    ``train_rollout_logprob_abs_diff``, ``kl_loss``, ``ois`` and the TIS function's metrics,
    ``opd_reverse_kl``.

    The per-token loss pg·w + ``kl_loss_coef``·KL − ``entropy_coef``·H is one fused
    ``policy_loss`` call reduced by ``sum_of_sample_mean``, with the TIS weight fused too
    when the TIS function is slime's default or ours. With a custom
    ``--custom-pg-loss-reducer-function-path`` or another TIS function, the pg term is its
    own call, handed to them as slime does. Refused (ValueError naming the argument):
    context parallelism, tensor parallelism, rollout top-p replay, OPSM, and GSPO with TIS,
    mismatch metrics, the unbiased KL or OPD."""
    _refuse(args)
    estimator = _arg(args, "advantage_estimator")
    use_tis = bool(_arg(args, "use_tis")) or bool(getattr(args, "get_mismatch_metrics", False))
    use_kl = bool(_arg(args, "use_kl_loss"))
    use_rollout = bool(getattr(args, "use_rollout_logprobs", False))
    entropy_coef = float(_arg(args, "entropy_coef"))
    low = float(_arg(args, "eps_clip"))
    high = getattr(args, "eps_clip_high", None)
    high = low if high is None else float(high)
    masks = batch["loss_masks"]

    logp, entropy, sizes = _log_probs_and_entropy(args, batch, logits, with_entropy_grad=entropy_coef != 0)
    device = logp.device
    lengths = torch.tensor(sizes, dtype=torch.long, device=device)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    mask = torch.cat([m.reshape(-1) for m in masks]).to(device) if masks else torch.zeros(0, device=device)
    if mask.shape != logp.shape:
        raise ValueError(f"batch['loss_masks']: expected {logp.shape[0]} tokens in all, got {mask.shape[0]}")
    mask = mask != 0
    advantages = torch.cat(list(batch["advantages"])).to(device)
    old_list = batch["rollout_log_probs"] if use_rollout else batch.get("log_probs")
    old = torch.cat(list(old_list)).to(device) if old_list else logp.detach()
    train_list = batch.get("log_probs")
    train_is_old = not use_rollout  # the TIS ratio's numerator is then the loss's old log-probs

    tis_func = None
    if use_tis:
        if "rollout_log_probs" not in batch:
            raise ValueError("batch['rollout_log_probs']: needed for TIS / mismatch metrics")
        path = getattr(args, "custom_tis_function_path", None)
        tis_func = _load_function(path) if path is not None else vanilla_tis_function
    reducer_path = getattr(args, "custom_pg_loss_reducer_function_path", None)
    fused_tis = tis_func in _OURS_TIS and train_is_old
    one_call = reducer_path is None and (tis_func is None or fused_tis)

    kl_kw: Dict[str, Any] = {}
    if use_kl:
        kl_loss_type = _arg(args, "kl_loss_type")
        if kl_loss_type not in _KL:
            raise ValueError(f"args.kl_loss_type: expected one of {tuple(_KL)}, got {kl_loss_type!r}")
        kind, clamp = _KL[kl_loss_type]
        kl_kw = dict(
            kl=kind,
            kl_coef=float(_arg(args, "kl_loss_coef")),
            kl_ratio_correction=bool(getattr(args, "use_unbiased_kl", False)),
            kl_clamp=clamp,
        )
        ref = torch.cat(list(batch["ref_log_probs"])).to(device)
    loss_type = {"gspo": "gspo", "cispo": "cispo"}.get(estimator, "ppo")
    common = dict(
        loss_type=loss_type,
        clip_low=low,
        clip_high=high,
        clip_ratio_c=getattr(args, "eps_clip_c", None),
        agg="none",
    )

    def call(options_kw, adv, *, with_terms: bool, rc=None):
        opts = resolve_policy_loss_options(
            "slime",
            **options_kw,
            **(kl_kw if with_terms else {}),
            entropy_coef=entropy_coef if with_terms else 0.0,
            rollout_correction=rc,
        )
        out, _ = policy_loss(
            logp,
            old,
            adv,
            mask,
            options=opts,
            ref_logprobs=ref if with_terms and use_kl else None,
            rollout_logprobs=rollout if rc is not None else None,
            entropy=entropy if with_terms and entropy_coef != 0 else None,
            cu_seqlens=cu,
            backend=current_backend(),
        )
        return out

    rollout = torch.cat(list(batch["rollout_log_probs"])).to(device) if use_tis else None
    tis_metrics: Dict[str, torch.Tensor] = {}
    if one_call:
        rc = None
        if tis_func is not None:
            rc = RolloutCorrection(
                is_level="token",
                is_mode=_OURS_TIS[tis_func],
                is_threshold=float(_arg(args, "tis_clip")),
                is_threshold_low=float(_arg(args, "tis_clip_low")),
            )
            tis_metrics = _tis_metrics(args, old, rollout)
        token_loss = call(common, advantages, with_terms=True, rc=rc)
        loss = sum_of_sample_mean(token_loss)
        with torch.no_grad():
            pg_tok = call(common, advantages, with_terms=False, rc=rc) if (use_kl or entropy_coef) else token_loss
            pg_loss = sum_of_sample_mean(pg_tok)
    else:
        pg_tok = call(common, advantages, with_terms=False)
        pg_masks = masks
        reducer = sum_of_sample_mean
        if tis_func is not None:
            train = train_list if train_list else list(logp.detach().split(sizes))
            pg_tok, pg_masks, tis_metrics = tis_func(
                args=args,
                pg_loss=pg_tok,
                train_log_probs=train,
                rollout_log_probs=batch["rollout_log_probs"],
                loss_masks=masks,
                total_lengths=batch["total_lengths"],
                response_lengths=batch["response_lengths"],
            )
            if pg_masks is not masks:
                # slime rebuilds its reducer on the returned masks, the denominators still the
                # rollouts' mask totals.
                if "rollout_mask_sums" not in batch:
                    raise ValueError("batch['rollout_mask_sums']: needed to reduce the masks the TIS function returned")
                reducer = _sample_mean_reducer(
                    sizes, pg_masks, batch["rollout_mask_sums"], bool(args.calculate_per_token_loss)
                )
        if reducer_path is not None:
            reducer = _load_function(reducer_path)(
                batch["total_lengths"], batch["response_lengths"], pg_masks, bool(args.calculate_per_token_loss)
            )
        pg_loss = reducer(pg_tok)
        loss = pg_loss
        if use_kl or entropy_coef:
            # The KL and entropy terms alone: the same fused call with zero advantages (its pg
            # term is then 0, value and gradient), per-token ratio for the unbiased KL.
            terms_kw = dict(common, loss_type="ppo")
            loss = loss + sum_of_sample_mean(call(terms_kw, torch.zeros_like(advantages), with_terms=True))

    if logp.numel() == 0:
        loss = loss + 0 * logits.sum()

    with torch.no_grad():
        lp = logp.detach()
        if estimator == "gspo":
            n = torch.segment_reduce(mask.float(), "sum", lengths=lengths).clamp_min(1)
            seq = torch.segment_reduce((old - lp) * mask, "sum", lengths=lengths) / n
            ppo_kl_tok = torch.repeat_interleave(seq, lengths, output_size=lp.shape[0])
        else:
            ppo_kl_tok = old - lp
        ratio = torch.exp(-ppo_kl_tok)
        adv = advantages.float()
        metrics = {
            "loss": loss.detach().clone(),
            "pg_loss": pg_loss.detach().clone(),
            "entropy_loss": sum_of_sample_mean(entropy.detach()),
            "pg_clipfrac": sum_of_sample_mean(_clipfrac(estimator, ratio, adv, low, high)),
            "ppo_kl": sum_of_sample_mean(ppo_kl_tok),
        }
        if batch.get("rollout_log_probs"):
            rl = torch.cat(list(batch["rollout_log_probs"])).to(device)
            metrics["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(((lp if use_rollout else old) - rl).abs())
        if use_kl:
            w = torch.exp(lp - old) if getattr(args, "use_unbiased_kl", False) else None
            metrics["kl_loss"] = sum_of_sample_mean(_kl_values(args.kl_loss_type, lp, ref, w))
        if use_tis:
            metrics["ois"] = sum_of_sample_mean(ratio)
            for key, value in tis_metrics.items():
                metrics[key] = sum_of_sample_mean(value)
        if batch.get("opd_reverse_kl"):
            metrics["opd_reverse_kl"] = sum_of_sample_mean(torch.cat(list(batch["opd_reverse_kl"])))
    return loss, metrics
