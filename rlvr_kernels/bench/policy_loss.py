"""Benchmark of ``policy_loss`` (forward + backward) against verl, eager PyTorch and
torch.compile.

Workload (the actor's loss step of a GRPO run with verl's defaults): B = 64 sequences,
L = 8192, response lengths uniform in [L/8, L] (about 56% of the tokens valid), bool mask,
fp32; PPO with ε_low = 0.2, ε_high = 0.28 and dual clip c = 3, k3 KL to a reference policy
with β = 0.1, token-level TIS rollout correction with cap C = 2, token-mean. Every method
computes the loss *and* ``loss.backward()`` into ``logprobs`` (a leaf; its ``.grad`` is
reset to None before each call), and the metrics a trainer logs.

Methods:
- fused: ``rlvr_kernels.policy_loss`` with sequence-level advantages ``[B]``.
- verl actor: ``integrations.verl.policy_loss_verl`` as verl's actor would call it: [B, L]
  advantages (as verl's trainer stores them), verl's ``ActorConfig``, the TIS weights fused
  (``rollout_log_probs``, ``rollout_is="token"``), float metrics (one host sync).
- verl: ``compute_rollout_correction_weights`` (token, 2.0) on old − rollout log-probs,
  ``compute_policy_loss_vanilla`` with a real ``ActorConfig``, ``kl_penalty("low_var_kl")``
  and ``agg_loss`` for the KL, summed as verl's actor (``pg_loss + kl_loss · kl_loss_coef``).
  verl's trainer stores advantages token-level, ``A_i · m_{i,t}`` as a [B, L] tensor, so
  they are materialised that way once, outside the timed call. The ``.item()`` host syncs
  inside verl's metric code are part of its cost and are kept.
- eager: the same math in plain torch ops on ``[B]`` advantages broadcast, with the same
  metrics as tensors (no ``.item()``).
- compiled: ``torch.compile`` (default mode) of the eager function; its compile warm-up
  (forward and backward graphs) is reported separately and excluded from the timing.
- copy: ``torch.empty_like(x).copy_(x)`` of a buffer as large as the bytes the fused op
  must move (inputs read once, the gradient written once), for the bandwidth fraction.

A second workload times every function-level verl drop-in of ``integrations.verl``
against verl's own function on the same shapes ([B, L] advantages, ``ActorConfig``,
token-mean), each forward + backward: ``compute_policy_loss_{vanilla,gspo,cispo,sapo,
gpg}``, ``kl_penalty`` (k3), ``agg_loss`` (token-mean and seq-mean-token-mean), the KL
term ``agg_loss(kl_penalty(...))`` and ``policy_loss_verl`` against the loss verl's
``ppo_loss`` computes (pg + kl_penalty + agg_loss). A drop-in slower than its peer is a
missed target.

The fused op must run: a missing or broken kernel raises (no stand-in backend).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import policy_loss
from ..integrations import verl as verl_dropins
from .advantages import _target
from .timing import time_fn

# The loss configuration of the workload (and of every method).
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
KL_COEF = 0.1
RC_CAP = 2.0
# The CPU targets (ratio = method time / fused time, all >=).
CPU_TARGETS = (("verl", 8.0), ("eager", 5.0), ("compiled", 1.5))


def make_inputs(device: str, quick: bool = False, seed: int = 0) -> Dict:
    """The workload's tensors: [B, L] fp32 log-probs (``logprobs`` a leaf requiring grad),
    a bool mask with ragged lengths uniform in [L/8, L], and ``[B]`` advantages."""
    B, L = (8, 1024) if quick else (64, 8192)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(L // 8, L + 1, (B,), generator=gen)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    # Log-probs of sampled tokens (<= 0); the current, reference and rollout policies sit
    # near the old one, so some ratios clip, the dual clip fires and some TIS weights cap.
    old = -torch.empty(B, L).exponential_(1.0, generator=gen)
    logprobs = old + 0.1 * torch.randn(B, L, generator=gen)
    ref = old + 0.1 * torch.randn(B, L, generator=gen)
    rollout = old + 0.3 * torch.randn(B, L, generator=gen)
    adv = torch.randn(B, generator=gen)
    to = dict(device=device)
    return dict(
        B=B,
        L=L,
        logprobs=logprobs.to(**to).requires_grad_(True),
        old=old.to(**to),
        ref=ref.to(**to),
        rollout=rollout.to(**to),
        adv=adv.to(**to),
        mask=mask.to(**to),
    )


def moved_bytes(x: Dict) -> int:
    """What the fused op must move at least: logprobs, old, ref and rollout read once
    (4 B/token each), the bool mask (1 B/token), the [B] advantages, the fp32 gradient
    written once (4 B/token)."""
    n = x["B"] * x["L"]
    return n * (4 * 4 + 1 + 4) + x["B"] * 4


def eager_policy_loss(logprobs, old, adv, mask, ref, rollout):
    """The workload's loss in plain torch ops (what one would write without a kernel):
    [B] advantages broadcast, metrics as 0-d tensors (no host sync)."""
    a = adv[:, None]
    m = mask.to(logprobs.dtype)
    n = m.sum()
    delta = (logprobs - old).clamp(-20.0, 20.0)
    ratio = delta.exp()
    l1 = -a * ratio
    l2 = -a * ratio.clamp(1.0 - CLIP_LOW, 1.0 + CLIP_HIGH)
    pg1 = torch.maximum(l1, l2)
    l3 = -a * CLIP_C
    pg = torch.where(a < 0, torch.minimum(pg1, l3), pg1)
    is_w = (old - rollout).clamp(-20.0, 20.0).exp().clamp(max=RC_CAP)
    y = (ref - logprobs).clamp(-20.0, 20.0)
    kl = (y.exp() - y - 1.0).clamp(-10.0, 10.0)
    pg_loss = (pg * is_w * m).sum() / n
    kl_loss = (kl * m).sum() / n
    loss = pg_loss + KL_COEF * kl_loss
    with torch.no_grad():
        metrics = dict(
            pg_loss=pg_loss.detach(),
            kl_loss=kl_loss.detach(),
            pg_clipfrac=((l2 > l1) * m).sum() / n,
            pg_clipfrac_lower=((pg1 > l3) & (a < 0) & mask).sum() / n,
            ppo_kl=(-delta * m).sum() / n,
            is_weight_mean=(is_w * m).sum() / n,
            is_weight_max=torch.where(mask, is_w, 0.0).max(),
        )
    return loss, metrics


def _verl():
    """verl's functions and an ActorConfig of the workload, or the import error."""
    try:
        from verl.trainer.ppo import core_algos, rollout_corr_helper
        from verl.workers.config.actor import ActorConfig  # noqa: F401  (verl's config must import)

        cfg = _actor_config(ACTOR_FIELDS)
        assert cfg.global_batch_info == {}  # token-mean over this call's tokens, dp_size 1
        return core_algos, rollout_corr_helper, cfg
    except Exception as e:  # reported as a row, not hidden
        return e


def _actor_config(cfg_fields: Dict):
    """verl's ActorConfig with these fields, or (verl missing) the same fields as a dict."""
    try:
        from verl.workers.config.actor import ActorConfig
    except Exception:
        return dict(cfg_fields)
    return ActorConfig(strategy="fsdp", rollout_n=16, ppo_micro_batch_size_per_gpu=1, **cfg_fields)


ACTOR_FIELDS = dict(
    clip_ratio_low=CLIP_LOW,
    clip_ratio_high=CLIP_HIGH,
    clip_ratio_c=CLIP_C,
    loss_agg_mode="token-mean",
    use_kl_loss=True,
    kl_loss_coef=KL_COEF,
    kl_loss_type="low_var_kl",
)


def _fused(lp, old, adv, mask, **options):
    """The fused op as every workload calls it: verl's preset, the workload's clip range,
    then ``options`` (the KL term, the rollout correction, validate)."""
    return policy_loss(lp, old, adv, mask, preset="verl", clip_low=CLIP_LOW, clip_high=CLIP_HIGH, **options)


def _fused_step(lp, old, adv, mask, **options):
    """A timed step of :func:`_fused`: forward + backward, returns (loss, grad)."""

    def step():
        lp.grad = None
        loss, _ = _fused(lp, old, adv, mask, **options)
        loss.backward()
        return loss, lp.grad

    return step


def _k3_tis(ref, rollout) -> Dict:
    """The main workload's options beyond the clip range: k3 KL at KL_COEF, token TIS at RC_CAP."""
    return dict(
        kl="k3",
        kl_coef=KL_COEF,
        rollout_correction="token_tis",
        rollout_threshold=RC_CAP,
        ref_logprobs=ref,
        rollout_logprobs=rollout,
    )


def _check_fused(x: Dict) -> None:
    """Run the fused op once on a slice of the inputs: a missing or broken kernel raises
    here, before anything is timed (the benchmark never times a stand-in)."""
    loss, _ = _fused(
        x["logprobs"].detach()[:1, :8],
        x["old"][:1, :8],
        x["adv"][:1],
        x["mask"][:1, :8],
        **_k3_tis(x["ref"][:1, :8], x["rollout"][:1, :8]),
    )
    if not bool(torch.isfinite(loss)):
        raise RuntimeError(f"policy_loss bench: the fused op returned {float(loss)} on finite inputs")


def methods(device: str, quick: bool = False, x: Optional[Dict] = None, compile_info: Optional[Dict] = None):
    """The workload's inputs and the (label, step, key) of every method; each step runs
    forward + backward and returns (loss, grad). (Long because it is a list: one short
    closure per compared method, side by side so their inputs are visibly the same.)"""
    x = make_inputs(device, quick) if x is None else x
    lp, old, ref, roll, adv, mask = x["logprobs"], x["old"], x["ref"], x["rollout"], x["adv"], x["mask"]
    _check_fused(x)
    adv_tok = adv[:, None] * mask  # as verl's trainer holds them: [B, L] fp32, 0 on padding
    actor_cfg = _actor_config(ACTOR_FIELDS)
    k3_tis = _k3_tis(ref, roll)

    def verl_actor_step():
        lp.grad = None
        loss, metrics = verl_dropins.policy_loss_verl(
            old,
            lp,
            adv_tok,
            mask,
            actor_cfg,
            ref_log_prob=ref,
            rollout_log_probs=roll,
            rollout_is="token",
            rollout_is_threshold=RC_CAP,
        )
        loss.backward()
        return loss, lp.grad

    def eager_step(fn):
        def step():
            lp.grad = None
            loss, metrics = fn(lp, old, adv, mask, ref, roll)
            loss.backward()
            return loss, lp.grad

        return step

    out: List[tuple] = [
        ("rlvr_kernels.policy_loss (fused op, [B] advantages)", _fused_step(lp, old, adv, mask, **k3_tis), "fused"),
        (
            "rlvr_kernels.policy_loss, validate=False (no finite check)",
            _fused_step(lp, old, adv, mask, validate=False, **k3_tis),
            "fused_novalidate",
        ),
        (
            "rlvr_kernels verl actor: integrations.verl.policy_loss_verl ([B, L] advantages, ActorConfig, "
            "fused TIS, float metrics)",
            verl_actor_step,
            "verl_actor",
        ),
    ]
    verl = _verl()
    if isinstance(verl, Exception):
        out.append((f"verl (not importable: {verl!r})"[:90], None, "verl"))
    else:
        core_algos, rc_helper, cfg = verl

        def verl_step():
            lp.grad = None
            # Driver side in verl (compute_rollout_correction_and_add_to_batch): log(π_old / π_rollout).
            is_w, is_metrics = rc_helper.compute_rollout_correction_weights(
                old - roll, mask, rollout_is="token", rollout_is_threshold=RC_CAP
            )
            # Actor side (verl.workers.utils.losses.ppo_loss).
            pg_loss, pg_metrics = core_algos.compute_policy_loss_vanilla(
                old_log_prob=old,
                log_prob=lp,
                advantages=adv_tok,
                response_mask=mask,
                loss_agg_mode=cfg.loss_agg_mode,
                config=cfg,
                rollout_is_weights=is_w,
            )
            kld = core_algos.kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty=cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(
                loss_mat=kld, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **cfg.global_batch_info
            )
            loss = pg_loss + kl_loss * cfg.kl_loss_coef
            loss.backward()
            return loss, lp.grad

        out.append(
            (
                "verl compute_policy_loss_vanilla + kl_penalty/agg_loss + TIS weights ([B, L] advantages, "
                "rollout_corr_helper.compute_rollout_correction_weights)",
                verl_step,
                "verl",
            )
        )
    out.append(
        (
            "eager torch, same math ([B] advantages broadcast, metrics as tensors)",
            eager_step(eager_policy_loss),
            "eager",
        )
    )
    try:
        torch._dynamo.reset()  # a fresh compile for this workload's shapes (no dynamic-shape recompile)
        compiled_step = eager_step(torch.compile(eager_policy_loss))
        t0 = time.perf_counter()
        compiled_step()  # compiles the forward and the backward graphs
        if device == "cuda":
            torch.cuda.synchronize()
        if compile_info is not None:
            compile_info["compile_s"] = time.perf_counter() - t0
        out.append(("torch.compile(eager torch), default mode (compile warm-up excluded)", compiled_step, "compiled"))
    except Exception as e:
        out.append((f"torch.compile (failed: {type(e).__name__})"[:90], None, "compiled"))
    return x, out


def check_agreement(steps: List[tuple]) -> Dict[str, float]:
    """Each method's loss and gradient against the fused op's (max abs differences); a
    benchmark of different math would be meaningless, so the workload fails on a mismatch."""
    ref_loss, ref_grad = None, None
    diffs = {}
    for _, fn, key in steps:
        if fn is None:
            continue
        loss, grad = fn()
        loss, grad = loss.detach().double(), grad.detach().double().clone()
        if ref_loss is None:
            ref_loss, ref_grad = loss, grad
            continue
        dl = float((loss - ref_loss).abs())
        dg = float((grad - ref_grad).abs().max())
        diffs[key] = {"loss_abs_diff": dl, "grad_max_abs_diff": dg}
        scale = float(ref_grad.abs().max()) or 1.0
        if not (dl <= 1e-4 * max(1.0, abs(float(ref_loss))) and dg <= 1e-4 * scale):
            raise AssertionError(
                f"policy_loss bench: {key} disagrees with the fused op: loss diff {dl:.3g}, "
                f"grad max diff {dg:.3g} (grad scale {scale:.3g})"
            )
    return diffs


def copy_step(nbytes: int, device: str) -> Callable[[], torch.Tensor]:
    """``torch.empty_like(x).copy_(x)`` of an ``nbytes`` fp32 buffer (fresh destination
    each call, as the fused op's gradient output is fresh)."""
    src = torch.rand(max(1, nbytes // 4), device=device)
    return lambda: torch.empty_like(src).copy_(src)


def time_interleaved(
    steps: List[tuple], device: str, repeats: int, warmup: int, leaves: Sequence[torch.Tensor] = ()
) -> Dict[str, Dict]:
    """Median time of each step, measured in rounds (every method once per round, in a
    shuffled order), so a change of load on a shared machine hits every method alike
    and the ratios hold.

    Each timed call ends by dropping the gradients of ``leaves``: every method pays for
    freeing its own gradient, never for the previous method's (freeing a [B, L] tensor
    ATen allocated can cost as much as a small fused call)."""

    def owning(fn):
        def run():
            fn()
            for t in leaves:
                t.grad = None

        return run

    live = [(key, owning(fn)) for _, fn, key in steps if fn is not None]
    times: Dict[str, List[float]] = {key: [] for key, _ in live}
    for _ in range(warmup):
        for _, fn in live:
            fn()
    order = random.Random(0)
    for _ in range(repeats):
        # A fresh order each round (seeded): a method that follows a heavy one runs on cold
        # caches and a trimmed heap, one that follows its twin on warm ones; no method should
        # always have the same neighbour.
        for key, fn in order.sample(live, len(live)):
            times[key].append(time_fn(fn, device, repeats=1, warmup=0)["ms"])
    return {key: {"ms": statistics.median(t), "min_ms": min(t), "runs": len(t)} for key, t in times.items()}


def workload(device: str, quick: bool = False) -> Dict:
    compile_info: Dict = {}
    x, steps = methods(device, quick, compile_info=compile_info)
    B, L = x["B"], x["L"]
    agreement = check_agreement(steps)
    repeats, warmup = (5, 1) if quick else (21, 3)
    nbytes = moved_bytes(x)
    copy_label = f"torch.empty_like(x).copy_(x), x = {nbytes / 1e6:.1f} MB (the fused op's bytes)"
    timed = time_interleaved(
        steps + [(copy_label, copy_step(nbytes, device), "copy")], device, repeats, warmup, leaves=[x["logprobs"]]
    )
    rows = {}
    for label, _, key in steps + [(copy_label, None, "copy")]:
        rows[key] = {"method": label, "key": key, **timed.get(key, {})}
    copy_gbps = 2 * (nbytes // 4) * 4 / (rows["copy"]["ms"] * 1e-3) / 1e9  # read + write
    fused = rows["fused"]["ms"]
    for r in rows.values():
        r["ratio"] = r["ms"] / fused if r.get("ms") else None
    for key in ("fused", "fused_novalidate"):
        r = rows[key]
        r["gbps"] = nbytes / (r["ms"] * 1e-3) / 1e9
        r["copy_fraction"] = r["gbps"] / copy_gbps
    targets = []
    for key, value in CPU_TARGETS:
        label = {"verl": "verl", "eager": "eager torch", "compiled": "torch.compile"}[key] + " / fused"
        if device != "cpu":  # the targets are CPU ones; elsewhere the ratio is shown
            targets.append(_target(label, rows, key, "fused", "info", None))
            continue
        targets.append(_target(label, rows, key, "fused", ">=", value))
    for key, _ in CPU_TARGETS:  # the same ratios against the op without its value checks
        label = {"verl": "verl", "eager": "eager torch", "compiled": "torch.compile"}[key]
        targets.append(_target(f"{label} / fused validate=False", rows, key, "fused_novalidate", "info", None))
    # what verl's actor gets through the integration ([B, L] advantages, config, float metrics)
    targets.append(_target("verl / verl actor (policy_loss_verl)", rows, "verl", "verl_actor", "info", None))
    targets.append(_target("verl actor / fused", rows, "verl_actor", "fused", "info", None))
    notes = [
        f"{B} x {L} tokens, {int(x['mask'].sum())} valid ({float(x['mask'].float().mean()):.0%}); "
        f"every method: forward + loss.backward(), then its gradient freed (in its time); methods timed in "
        f"interleaved rounds ({repeats} rounds, median)",
        "verl: token-level advantages materialised once as adv[:, None] * mask ([B, L] fp32, as verl's "
        "trainer stores them), outside the timed call; its .item() metric syncs are timed",
        f"bytes the fused op must move: {nbytes / 1e6:.1f} MB (4 fp32 inputs + bool mask + [B] advantages read, "
        f"fp32 grad written); copy rate {copy_gbps:.1f} GB/s counts read + write",
    ]
    if "compile_s" in compile_info:
        notes.append(
            f"torch.compile warm-up (first forward + backward, compile included): "
            f"{compile_info['compile_s']:.1f} s, not in its time"
        )
    notes.append(
        "loss / grad agreement with the fused op (max abs diff): "
        + ", ".join(f"{k} {v['loss_abs_diff']:.1e} / {v['grad_max_abs_diff']:.1e}" for k, v in agreement.items())
    )
    kind = "quick" if quick else "actor"
    return {
        "name": f"{kind} workload: B={B}, L={L}, ragged (lengths U[L/8, L]), bool mask, fp32; ppo + dual clip "
        f"(c={CLIP_C}, eps={CLIP_LOW}/{CLIP_HIGH}) + k3 KL (beta={KL_COEF}) + token TIS (C={RC_CAP}), "
        "token-mean; forward + backward",
        "rows": list(rows.values()),
        "targets": targets,
        "copy_gbps": copy_gbps,
        "compile_s": compile_info.get("compile_s"),
        "agreement": agreement,
        "notes": notes,
    }


# ---------------------------------------------------------------------------------------
# Function-level verl drop-ins against verl's own functions
# ---------------------------------------------------------------------------------------

DROPIN_LOSS_MODES = (
    "vanilla",
    "gspo",
    "cispo",
    "sapo",
    "gpg",
    "dppo_tv",
    "dppo_kl",
    "geo_mean",
    "dro",
    "clip_cov",
    "kl_cov",
    "bypass_mode",
)
# bypass_mode: REINFORCE with sequence IS and a seq_mean_k1 rejection (the trainer passes the
# rollout's log-probs as old_log_prob)
BYPASS_RC = dict(
    loss_type="reinforce",
    rollout_is="sequence",
    rollout_is_threshold=2.0,
    rollout_rs="seq_mean_k1",
    rollout_rs_threshold="0.8_1.25",
)
DRO_BETA = 0.1  # dro's β (config.policy_loss.dro_beta; verl has no default)
COV_SEED = 0  # clip_cov draws torch.randperm from the global RNG: both sides seed it alike
_COV_LABELS = ("compute_policy_loss_clip_cov", "compute_policy_loss_kl_cov")


# the rollout_corr_helper drop-in's row: sequence IS, a seq_mean_k3 + token_k1 chain
RCH_OPTIONS = dict(
    rollout_is="sequence",
    rollout_is_threshold=2.0,
    rollout_rs="seq_mean_k3,token_k1",
    rollout_rs_threshold="0.05,0.5_2.0",
)


def dropin_pairs(x: Dict):
    """(name, drop-in step, verl step) for every function-level verl drop-in of the policy
    loss, on the workload's shapes; each step runs forward + backward and returns (loss,
    grad). None when verl is not importable."""
    verl = _verl()
    if isinstance(verl, Exception):
        return None
    core_algos, verl_rch, cfg = verl
    lp, old, ref, adv, mask = x["logprobs"], x["old"], x["ref"], x["adv"], x["mask"]
    adv_tok = adv[:, None] * mask  # verl's [B, L] advantages
    gen = torch.Generator().manual_seed(1)
    up = torch.randn(lp.shape, generator=gen).to(lp.device)  # an upstream gradient for kl_penalty
    mat = (x["ref"] - x["old"]).clone().requires_grad_(True)  # a loss matrix for agg_loss
    x["agg_matrix"] = mat  # (a leaf whose gradient the timing drops after each call)
    ours = verl_dropins

    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config.actor import PolicyLossConfig

    # (clip_cov / kl_cov: verl's default ratios, bounds and coefficient)
    configs = {
        mode: _actor_config(dict(ACTOR_FIELDS, policy_loss=PolicyLossConfig(loss_mode=mode, **kw)))
        for mode, kw in (
            ("dro", dict(dro_beta=DRO_BETA)),
            ("clip_cov", {}),
            ("kl_cov", {}),
            ("bypass_mode", dict(rollout_correction=RolloutCorrectionConfig(**BYPASS_RC))),
        )
    }

    def policy_step(fn, config=cfg, seed=None):
        def step():
            if seed is not None:
                torch.manual_seed(seed)
            lp.grad = None
            loss, _ = fn(old, lp, adv_tok, mask, "token-mean", config)
            loss.backward()
            return loss, lp.grad

        return step

    def kl_step(mod):
        def step():
            lp.grad = None
            kl = mod.kl_penalty(lp, ref, "low_var_kl")
            kl.backward(up)
            return kl.detach().sum(), lp.grad

        return step

    def agg_step(mod, mode):
        def step():
            mat.grad = None
            loss = mod.agg_loss(mat, mask, mode)
            loss.backward()
            return loss, mat.grad

        return step

    def kl_term_step(mod):
        def step():
            lp.grad = None
            loss = mod.agg_loss(mod.kl_penalty(lp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode)
            loss.backward()
            return loss, lp.grad

        return step

    def actor_ours():
        lp.grad = None
        loss, _ = ours.policy_loss_verl(old, lp, adv_tok, mask, cfg, ref_log_prob=ref)
        loss.backward()
        return loss, lp.grad

    def actor_verl():  # verl.workers.utils.losses.ppo_loss's arithmetic on the padded tensors
        lp.grad = None
        pg_loss, _ = core_algos.compute_policy_loss_vanilla(
            old_log_prob=old,
            log_prob=lp,
            advantages=adv_tok,
            response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode,
            config=cfg,
        )
        kld = core_algos.kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty=cfg.kl_loss_type)
        kl_loss = core_algos.agg_loss(kld, mask, cfg.loss_agg_mode, **cfg.global_batch_info)
        loss = pg_loss + kl_loss * cfg.kl_loss_coef
        loss.backward()
        return loss, lp.grad

    pairs = []
    for mode in DROPIN_LOSS_MODES:
        name = f"compute_policy_loss_{mode}"
        config, seed = configs.get(mode, cfg), (COV_SEED if mode == "clip_cov" else None)
        pairs.append(
            (name, policy_step(getattr(ours, name), config, seed), policy_step(getattr(core_algos, name), config, seed))
        )
    pairs += [
        ("kl_penalty (low_var_kl)", kl_step(ours), kl_step(core_algos)),
        ("agg_loss (token-mean)", agg_step(ours, "token-mean"), agg_step(core_algos, "token-mean")),
        (
            "agg_loss (seq-mean-token-mean)",
            agg_step(ours, "seq-mean-token-mean"),
            agg_step(core_algos, "seq-mean-token-mean"),
        ),
        ("agg_loss(kl_penalty(...)) (the KL term)", kl_term_step(ours), kl_term_step(core_algos)),
        ("policy_loss_verl vs ppo_loss (pg + kl_penalty + agg_loss)", actor_ours, actor_verl),
    ]
    from ..integrations.verl import rollout_corr_helper as ours_rch

    def rch_step(mod):  # no gradient: (Σ weights, the modified mask) for the agreement
        def step():
            w, keep, _ = mod.compute_rollout_correction_and_rejection_mask(old, x["rollout"], mask, **RCH_OPTIONS)
            return w.batch["rollout_is_weights"].sum(), keep.float()

        return step

    pairs.append(
        ("rollout_corr_helper.compute_rollout_correction_and_rejection_mask", rch_step(ours_rch), rch_step(verl_rch))
    )
    return pairs


def dropin_workload(device: str, quick: bool = False) -> Dict:
    """Every function-level verl drop-in against verl's function; ratio = time / the
    drop-in's time, target: verl's time / the drop-in's >= 1."""
    x = make_inputs(device, quick)
    B, L = x["B"], x["L"]
    name = (
        f"verl drop-ins vs verl: B={B}, L={L}, ragged, bool mask, fp32, [B, L] advantages, ActorConfig "
        "(ppo + dual clip, k3 KL), token-mean; forward + backward"
    )
    pairs = dropin_pairs(x)
    if pairs is None:
        return {"name": name, "rows": [], "targets": [], "notes": [f"verl is not importable: {_verl()!r}"]}
    steps, agreement, kept, refused = [], {}, [], []
    for i, (label, ours_step, verl_step) in enumerate(pairs):
        pair = [(f"rlvr_kernels {label}", ours_step, f"dropin_{i}"), (f"verl {label}", verl_step, f"verl_{i}")]
        try:
            agreement[label] = check_agreement(pair)[f"verl_{i}"]
        except RuntimeError as e:
            # the Triton kernel refuses clip_cov / kl_cov (docs/policy-loss.md): said in the notes
            if x["logprobs"].device.type == "cpu" or label not in _COV_LABELS:
                raise
            refused.append(f"{label}: {e}")
            continue
        kept.append((i, label))
        steps += pair
    repeats, warmup = (5, 1) if quick else (21, 3)
    timed = time_interleaved(steps, device, repeats, warmup, leaves=[x["logprobs"], x["agg_matrix"]])
    rows, targets = [], []
    for i, label in kept:
        mine, theirs = timed[f"dropin_{i}"], timed[f"verl_{i}"]
        rows.append({"method": f"rlvr_kernels {label}", "key": f"dropin_{i}", **mine, "ratio": 1.0})
        rows.append({"method": f"verl {label}", "key": f"verl_{i}", **theirs, "ratio": theirs["ms"] / mine["ms"]})
        targets.append(
            {
                "target": f"verl / drop-in, {label} >= 1.0",
                "measured": theirs["ms"] / mine["ms"],
                "met": theirs["ms"] >= mine["ms"],
            }
        )
    notes = [
        f"{B} x {L} tokens, {int(x['mask'].sum())} valid; each pair: the same inputs, forward + backward "
        f"(kl_penalty: backward of a fixed random upstream gradient); ratio = time / the drop-in's time; "
        f"all methods timed in interleaved rounds ({repeats} rounds, median)",
        "loss / grad agreement, verl vs drop-in (max abs diff): "
        + ", ".join(f"{k} {v['loss_abs_diff']:.1e} / {v['grad_max_abs_diff']:.1e}" for k, v in agreement.items()),
    ]
    notes += [f"not run on {device}: {r}" for r in refused]
    return {"name": name, "rows": rows, "targets": targets, "notes": notes}


# ---------------------------------------------------------------------------------------
# A chained rollout correction with the PPO loss, against verl's helper plus its pg loss
# ---------------------------------------------------------------------------------------

# Sequence TIS at C, the geometric-mean sequence mask [GEO_LOW, GEO_HIGH] (SkyRL's default
# bounds) and seq_mean_k3 rejection at CHAIN_K3: some sequences of the workload are rejected
# by each criterion.
GEO_LOW, GEO_HIGH, CHAIN_K3 = 0.99, 1.01, 0.046


def chained_correction(device: str, quick: bool = False) -> Dict:
    """policy_loss with RolloutCorrection(sequence IS + geometric mask + seq_mean_k3) against
    verl's ``compute_rollout_correction_and_rejection_mask`` followed by
    ``compute_policy_loss_vanilla`` with its weights and modified mask (what verl's trainer
    and actor run for the same configuration); ratio = time / the fused op's time."""
    from ..options import RolloutCorrection

    x = make_inputs(device, quick)
    B, L = x["B"], x["L"]
    lp, old, roll, adv, mask = x["logprobs"], x["old"], x["rollout"], x["adv"], x["mask"]
    adv_tok = adv[:, None] * mask
    name = (
        f"chained rollout correction: B={B}, L={L}, ragged, bool mask, fp32; ppo + dual clip, sequence TIS "
        f"(C={RC_CAP}) + geometric mask [{GEO_LOW}, {GEO_HIGH}] + seq_mean_k3 <= {CHAIN_K3}, token-mean; "
        "forward + backward"
    )
    verl = _verl()
    if isinstance(verl, Exception):
        return {"name": name, "rows": [], "targets": [], "notes": [f"verl is not importable: {verl!r}"]}
    core_algos, rc_helper, _ = verl
    cfg = _actor_config(dict(ACTOR_FIELDS, use_kl_loss=False))
    rc = RolloutCorrection(
        is_level="sequence",
        is_threshold=RC_CAP,
        rs="seq_mean_k3",
        rs_threshold=CHAIN_K3,
        geo_mean=(GEO_LOW, GEO_HIGH),
    )

    def verl_step():
        lp.grad = None
        # verl's seq_mean_k1 bounds of the geometric mask: k1 = −x, so (1/high, 1/low).
        weights, keep, _ = rc_helper.compute_rollout_correction_and_rejection_mask(
            old,
            roll,
            mask,
            rollout_is="sequence",
            rollout_is_threshold=RC_CAP,
            rollout_rs="seq_mean_k1,seq_mean_k3",
            rollout_rs_threshold=f"{1 / GEO_HIGH}_{1 / GEO_LOW},{CHAIN_K3}",
        )
        loss, _ = core_algos.compute_policy_loss_vanilla(
            old_log_prob=old,
            log_prob=lp,
            advantages=adv_tok,
            response_mask=keep,
            loss_agg_mode=cfg.loss_agg_mode,
            config=cfg,
            rollout_is_weights=weights.batch["rollout_is_weights"],
        )
        loss.backward()
        return loss, lp.grad

    steps = [
        (
            "rlvr_kernels.policy_loss, RolloutCorrection (fused)",
            _fused_step(lp, old, adv, mask, rollout_correction=rc, rollout_logprobs=roll),
            "fused",
        ),
        (
            "verl compute_rollout_correction_and_rejection_mask + compute_policy_loss_vanilla "
            "([B, L] advantages, modified mask)",
            verl_step,
            "verl",
        ),
    ]
    agreement = check_agreement(steps)
    with torch.no_grad():
        _, keep, _ = rc_helper.compute_rollout_correction_and_rejection_mask(
            old,
            roll,
            mask,
            rollout_rs="seq_mean_k1,seq_mean_k3",
            rollout_rs_threshold=f"{1 / GEO_HIGH}_{1 / GEO_LOW},{CHAIN_K3}",
        )
    rejected = int((keep.sum(-1) < mask.sum(-1)).sum())
    repeats, warmup = (5, 1) if quick else (21, 3)
    timed = time_interleaved(steps, device, repeats, warmup, leaves=[lp])
    rows = [{"method": label, "key": key, **timed[key]} for label, _, key in steps]
    for r in rows:
        r["ratio"] = r["ms"] / timed["fused"]["ms"]
    by_key = {r["key"]: r for r in rows}
    target = _target("verl / fused", by_key, "verl", "fused", *((">=", 5.0) if device == "cpu" else ("info", None)))
    notes = [
        f"{B} x {L} tokens, {int(mask.sum())} valid; {rejected} of {B} sequences rejected by the chain; "
        f"interleaved rounds ({repeats} rounds, median); verl's .item() metric syncs are timed",
        "loss / grad agreement with the fused op (max abs diff): "
        + ", ".join(f"{k} {v['loss_abs_diff']:.1e} / {v['grad_max_abs_diff']:.1e}" for k, v in agreement.items()),
    ]
    return {"name": name, "rows": rows, "targets": [target], "notes": notes}


WORKLOADS: Dict[str, Callable] = {
    "ppo_dualclip_k3_tis": workload,
    "verl_dropins": dropin_workload,
    "chained_correction": chained_correction,
}
