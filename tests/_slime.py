"""A literal fp64 transcription of slime's formulas (THUDM/slime at 624b824; slime is not an
installable package), written out from slime/utils/ppo_utils.py, slime/backends/megatron_utils/
loss.py and cp_utils.py without context parallelism: the expected values of the slime tests.
One sample at a time, in slime's order of operations."""

import math

import torch


def sum_of_sample_mean(response_lengths, loss_masks, denoms=None, per_token=False):
    """cp_utils.get_sum_of_sample_mean (cp = 1): Σ_i (x_i·m_i).sum() / clamp_min(d_i, 1)."""
    if denoms is None:
        denoms = [m.sum() for m in loss_masks]

    def reduce(x):
        parts = x.split(list(response_lengths))
        if per_token:
            return sum((xi * mi.to(x.dtype)).sum() for xi, mi in zip(parts, loss_masks))
        return sum(
            (xi * mi.to(x.dtype)).sum() / torch.clamp_min(torch.as_tensor(d, dtype=x.dtype), 1)
            for xi, mi, d in zip(parts, loss_masks, denoms)
        )

    return reduce


def grpo_returns(rewards, kl):
    return [torch.ones_like(k, dtype=torch.float64) * r for r, k in zip(rewards, kl)]


def rpp_baseline(rewards, kl, kl_coef):
    return [torch.ones_like(k, dtype=torch.float64) * r - kl_coef * k.double() for r, k in zip(rewards, kl)]


def rpp_returns(rewards, kl, masks, kl_coef, gamma):
    out = []
    for r, k, m in zip(rewards, kl, masks):
        tok = -kl_coef * (k.double() * m.double())
        last = int(m.nonzero()[-1])
        tok[last] += r
        g, run = torch.zeros_like(tok), 0.0
        for t in range(tok.shape[0] - 1, -1, -1):
            run = float(tok[t]) + gamma * run
            g[t] = run
        out.append(g)
    return out


def gae(rewards, kl, values, kl_coef, gamma, lambd):
    advs, rets = [], []
    for r, k, v in zip(rewards, kl, values):
        tok = k.double() * -kl_coef
        tok[-1] += r
        v = v.double()
        L = v.shape[0]
        a, last = torch.zeros(L, dtype=torch.float64), 0.0
        for t in range(L - 1, -1, -1):
            nxt = float(v[t + 1]) if t < L - 1 else 0.0
            delta = float(tok[t]) + gamma * nxt - float(v[t])
            last = delta + gamma * lambd * last
            a[t] = last
        advs.append(a)
        rets.append(a + v)
    return advs, rets


def approx_kl(logp, ref, kind, ratio=None):
    x = logp - ref
    if kind == "k1":
        kl = x
    elif kind == "k2":
        kl = x**2 / 2
    else:
        y = -x
        kl = y.exp() - 1 - y
    if ratio is not None:
        kl = ratio * kl
    if kind == "low_var_kl":
        kl = torch.clamp(kl, -10, 10)
    return kl


def tis_weights(kind, train, rollout, low, high):
    ratio = torch.exp(train - rollout)
    if kind == "vanilla":
        w = torch.clamp(ratio, min=low, max=high)
    else:
        w = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    return w, ratio


def policy_loss(args, batch, logits, denoms, tis=None, tis_masks=None, pg_denoms="rollout"):
    """policy_loss_function in fp64 with its gradient to ``logits`` (a float64 leaf). ``tis``:
    None | "vanilla" | "icepop"; ``tis_masks``: the masks a rejecting TIS function returns
    (the pg reducer's; its denominators: ``pg_denoms`` "rollout" = slime's rebuilt reducer,
    "own" = the masks' own counts, a custom pg reducer's)."""
    x = logits[0] / args.rollout_temperature
    lsm = torch.log_softmax(x, -1)
    ent_all = -(lsm.exp() * lsm).sum(-1)
    logps, ents, end = [], [], 0
    for tokens, total, resp in zip(batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"]):
        end += total
        rows = torch.arange(end - resp - 1, end - 1)
        logps.append(lsm[rows, tokens[-resp:]])
        ents.append(ent_all[rows])
    masks = batch["loss_masks"]
    ssm = sum_of_sample_mean(batch["response_lengths"], masks, denoms, args.calculate_per_token_loss)
    adv = torch.cat(batch["advantages"]).double()
    old_list = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
    old_list = [o.double() for o in old_list] if old_list else [lp.detach() for lp in logps]
    if args.advantage_estimator == "gspo":
        ppo_kl = torch.cat(
            [
                (((o - lp) * m).sum() / torch.clamp_min(m.sum(), 1)).expand_as(lp)
                for lp, o, m in zip(logps, old_list, masks)
            ]
        )
    else:
        ppo_kl = torch.cat(old_list) - torch.cat(logps)
    logp, old = torch.cat(logps), torch.cat(old_list)
    ratio = (-ppo_kl).exp()
    lo, hi = args.eps_clip, args.eps_clip_high
    if args.advantage_estimator == "cispo":
        trunc = torch.clamp(ratio, 1 - lo, 1 + hi)
        pg = -trunc.detach() * adv * logp
        clipfrac = (trunc != ratio).double()
    else:
        pg1 = -ratio * adv
        pg2 = -ratio.clamp(1 - lo, 1 + hi) * adv
        c1 = torch.maximum(pg1, pg2)
        clipfrac = torch.gt(pg2, pg1).double()
        if args.eps_clip_c is not None:
            pg = torch.where(adv < 0, torch.min(-args.eps_clip_c * adv, c1), c1)
        else:
            pg = c1
    out = {}
    pg_reduce = ssm
    if tis is not None:
        train = torch.cat([t.double() for t in batch["log_probs"]]) if batch.get("log_probs") else logp.detach()
        rollout = torch.cat(batch["rollout_log_probs"]).double()
        w, tratio = tis_weights(tis, train, rollout, args.tis_clip_low, args.tis_clip)
        pg = pg * w
        out["ois"] = ssm(ratio).detach()
        out["tis"] = ssm(tratio)
        out["tis_clipfrac"] = ssm((w != tratio).double())
        out["tis_abs"] = ssm((tratio - 1).abs())
        if tis_masks is not None:
            d = denoms if pg_denoms == "rollout" else None
            pg_reduce = sum_of_sample_mean(batch["response_lengths"], tis_masks, d, args.calculate_per_token_loss)
    elif tis_masks is not None:
        pg_reduce = sum_of_sample_mean(batch["response_lengths"], tis_masks, None, args.calculate_per_token_loss)
    pg_loss = pg_reduce(pg)
    entropy_loss = ssm(torch.cat(ents))
    loss = pg_loss - args.entropy_coef * entropy_loss
    if args.use_kl_loss:
        ref = torch.cat(batch["ref_log_probs"]).double()
        r = torch.exp(logp - old) if args.use_unbiased_kl else None
        kl_loss = ssm(approx_kl(logp, ref, args.kl_loss_type, r))
        loss = loss + args.kl_loss_coef * kl_loss
        out["kl_loss"] = kl_loss.detach()
    out.update(
        loss=loss.detach(),
        pg_loss=pg_loss.detach(),
        entropy_loss=entropy_loss.detach(),
        pg_clipfrac=ssm(clipfrac),
        ppo_kl=ssm(ppo_kl).detach(),
    )
    if batch.get("rollout_log_probs"):
        rl = torch.cat(batch["rollout_log_probs"]).double()
        cmp = logp if args.use_rollout_logprobs else old
        out["train_rollout_logprob_abs_diff"] = ssm((cmp - rl).abs()).detach()
    return loss, out


def isclose(a, b, rel=1e-5, abs_=1e-6):
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=abs_)


# A TIS function of the user's own, selected by path in the tests: vanilla TIS that also
# rejects (mask 0) the tokens whose ratio exceeds args.reject_above.
def reject_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    train, rollout = torch.cat(train_log_probs), torch.cat(rollout_log_probs)
    ratio = torch.exp(train - rollout)
    w = torch.clamp(ratio, min=args.tis_clip_low, max=args.tis_clip)
    keep = (ratio <= args.reject_above).to(loss_masks[0].dtype)
    new = [m * k for m, k in zip(loss_masks, keep.split([len(m) for m in loss_masks]))]
    metrics = {"tis": ratio, "tis_clipfrac": (w != ratio).float(), "tis_abs": (ratio - 1).abs()}
    return pg_loss * w, new, metrics


def reject_masks(args, batch):
    """The masks reject_tis returns, in fp64 from the batch."""
    train = torch.cat(batch["log_probs"]).double()
    ratio = torch.exp(train - torch.cat(batch["rollout_log_probs"]).double())
    keep = (ratio <= args.reject_above).long()
    return [m * k for m, k in zip(batch["loss_masks"], keep.split([len(m) for m in batch["loss_masks"]]))]
