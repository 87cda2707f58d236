"""``linear_logprobs`` + ``policy_loss`` against Liger-Kernel's ``LigerFusedLinearGRPOLoss``.

The README ("What each op computes, and its peers' equivalents") maps each of Liger's GRPO
loss types (``liger_kernel.chunked_loss.grpo_loss``, token-level importance sampling) to
our options: the clip types ``dapo``/``bnpo`` (``agg="token-mean"``), ``grpo``
(``"seq-mean-token-mean"`` over all B rows) and ``dr_grpo`` (``"seq-mean-token-sum-norm"``,
÷ B·``max_completion_length``) are ``loss_type="ppo"``; ``cispo`` (which clips at the ratio
ε_high itself) is ``loss_type="cispo", clip_low=1, clip_high=ε_high − 1``; ``sapo`` is
``loss_type="sapo"`` with ``tau_pos/tau_neg``, aggregated as ``grpo``. Liger's ``beta`` is
our ``kl="k3"`` (no clamps: ``preset="trl"``), its ``use_bias_correction_kl`` our
``kl_ratio_correction``, its ``delta`` (> 1 + ε_high) our ``clip_ratio_c``. Liger divides
the logits by ``temperature``, as ``linear_logprobs(temperature=)``.

Each case runs, on one small batch (B=5 rows: full, padded, fully masked, ...; T=7, H=16,
V=37; temperature 0.7; advantages of both signs; old log-probs off the current ones so
that the ratio clips on both sides; a reference model given as its own hidden states and
head):

- Liger's module (float32, as Liger always computes its log-probs) and ours in float32:
  the loss, d/d hidden, d/d weight, and Liger's two metrics (the mean KL term and the
  clipped fraction) against ours. The loss and gradients follow the project's tolerance
  rule |ours − ref64| ≤ 2·|liger − ref64| + atol (``rlvr_kernels.testing.compare``), with
  ref64 = Liger's own loss function (``LigerFusedLinearGRPOFunction.ppo_loss_fn``) on
  float64 log-probs from a float64 ``log_softmax``, differentiated by autograd.
- Ours in float64 against that same ref64 at 1e-12 relative: a formula difference cannot
  hide there under float32 rounding.

A second test adds Liger's ``delta``, an LM-head bias, two rows per Liger chunk and, for
``dapo``, ``num_items_in_batch`` (our ``global_num_tokens``).

Liger runs with ``compiled=False``: ``compiled=True`` only wraps the same loss function
in ``torch.compile`` (an Inductor C++ build on CPU, seconds per case), the math is the same.

Not covered (not matched by our options): Liger's ``luspo`` (it weights every position,
padding included, by the row's token count n_i and divides by B·T, see
``grpo_loss.py`` ``elif loss_type == "luspo"``; our ``seq-mean-token-sum`` is TRL 1.16's
masked form), ``vespo`` (no loss type of ours: ``reinforce`` on A times a per-sequence
weight the caller computes), ``cispo`` with ε_high < 1, ``delta`` ≤ 1 + ε_high. Liger's
GRPO module returns no entropy, so there is no entropy comparison here.
"""

from __future__ import annotations

import pytest
import torch
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

import rlvr_kernels as rk
from rlvr_kernels.options import resolve_policy_loss_options
from rlvr_kernels.testing import compare

B, T, H, V = 5, 7, 16, 37
LENGTHS = (T, 4, 0, 6, 2)  # a full row, padded rows, a fully masked row
ADVANTAGES = (0.9, -1.3, 0.7, -0.4, 1.1)  # per sequence, both signs (row 2's is masked out)
TEMPERATURE = 0.7
MAX_COMPLETION_LENGTH = 11  # dr_grpo's constant divisor, deliberately ≠ T
PAD_ID = 0
EPS_LOW, EPS_HIGH = 0.2, 0.28  # DAPO's clip-higher, so the two sides differ
CISPO_EPS_HIGH = 1.3  # Liger's cispo clips the ratio at ε_high itself
SAPO_TAU = (1.3, 0.9)  # not Liger's defaults (1.0, 1.05), so the mapping is tested
LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo", "cispo", "sapo")
KL_CASES = [(0.0, False), (0.04, False), (0.04, True)]  # (beta, use_bias_correction_kl)
F64_RTOL = 1e-12  # (the two agree to ~1e-15 relative; float64 rounding of sums of ~40 terms)


def make_batch(seed: int = 0, bias: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2 / H**0.5)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    ids = torch.where(mask, torch.randint(0, V, (B, T), generator=gen), PAD_ID)
    # The reference model: nearby hidden states and head.
    ref_hidden = hidden + 0.3 * torch.randn(B, T, H, generator=gen)
    ref_weight = weight + 0.1 * torch.randn(V, H, generator=gen)
    b = 0.5 * torch.randn(V, generator=gen) if bias else None
    # old = current − δ: small moves, and ~1 in 4 far ones, so both clip sides are hit.
    current = logprobs64(hidden.double(), weight.double(), ids, b)
    delta = 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    far = torch.rand(B, T, generator=gen) < 0.25
    jump = torch.randn(B, T, generator=gen, dtype=torch.float64).sign() * (0.5 + torch.rand(B, T, generator=gen))
    old = (current - torch.where(far, jump, delta)).float()
    return dict(
        hidden=hidden,
        weight=weight,
        bias=b,
        ids=ids,
        mask=mask.long(),  # TRL's completion_mask is an int tensor
        advantages=torch.tensor(ADVANTAGES),
        old=old,
        ref_hidden=ref_hidden,
        ref_weight=ref_weight,
    )


def logprobs64(hidden, weight, ids, bias=None):
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias.double()
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, ids[..., None]).squeeze(-1)


def liger_config(loss_type, beta, bias_kl, delta=None) -> dict:
    return dict(
        beta=beta,
        use_bias_correction_kl=bias_kl,
        loss_type=loss_type,
        epsilon_low=EPS_LOW,
        epsilon_high=CISPO_EPS_HIGH if loss_type == "cispo" else EPS_HIGH,
        max_completion_length=MAX_COMPLETION_LENGTH,
        importance_sampling_level="token",
        sapo_temperature_pos=SAPO_TAU[0],
        sapo_temperature_neg=SAPO_TAU[1],
        temperature=TEMPERATURE,
        delta=delta,
    )


def ours_config(loss_type, beta, bias_kl, delta=None) -> dict:
    """The README's mapping: ``policy_loss`` arguments for a Liger configuration."""
    fields = dict(kl="k3" if beta else None, kl_coef=beta, kl_ratio_correction=bias_kl)
    if loss_type == "cispo":
        fields.update(loss_type="cispo", clip_low=1.0, clip_high=CISPO_EPS_HIGH - 1.0)
    elif loss_type == "sapo":
        fields.update(loss_type="sapo", tau_pos=SAPO_TAU[0], tau_neg=SAPO_TAU[1])
    else:
        fields.update(loss_type="ppo", clip_low=EPS_LOW, clip_high=EPS_HIGH, clip_ratio_c=delta)
    counts = {}
    if loss_type in ("grpo", "sapo"):
        fields["agg"] = "seq-mean-token-mean"
        counts = dict(global_num_seqs=B)  # Liger divides by B, the fully masked row included
    elif loss_type == "dr_grpo":
        fields["agg"] = "seq-mean-token-sum-norm"
        counts = dict(global_num_seqs=B, loss_scale_factor=MAX_COMPLETION_LENGTH)
    else:  # dapo, bnpo, cispo: ÷ this batch's valid tokens
        fields["agg"] = "token-mean"
    # tau_pos / tau_neg are not keyword arguments of policy_loss: the options object carries
    # them (resolve_policy_loss_options is what policy_loss(preset="trl", ...) calls).
    return dict(options=resolve_policy_loss_options("trl", **fields), **counts)


def run_liger(batch, cfg, chunk_size=1, num_items=None):
    module = LigerFusedLinearGRPOLoss(compiled=False, use_ref_model=cfg["beta"] != 0, chunk_size=chunk_size, **cfg)
    hidden = batch["hidden"].clone().requires_grad_(True)
    weight = batch["weight"].clone().requires_grad_(True)
    bias = batch["bias"].clone().requires_grad_(True) if batch["bias"] is not None else None
    ref = dict(ref_input=batch["ref_hidden"], ref_weight=batch["ref_weight"]) if cfg["beta"] else {}
    loss, metrics = module(
        hidden,
        weight,
        batch["ids"],
        batch["mask"],
        batch["advantages"],
        bias=bias,
        old_per_token_logps=batch["old"],
        num_items_in_batch=num_items,
        **ref,
    )
    loss.backward()
    return _result(loss, hidden, weight, bias), metrics


def run_liger64(batch, cfg, num_items=None):
    """Liger's own loss function on float64 log-probs (float64 log_softmax, autograd)."""
    hidden = batch["hidden"].double().requires_grad_(True)
    weight = batch["weight"].double().requires_grad_(True)
    bias = batch["bias"].double().requires_grad_(True) if batch["bias"] is not None else None
    ref = logprobs64(batch["ref_hidden"].double(), batch["ref_weight"].double(), batch["ids"]) if cfg["beta"] else None
    loss, _ = LigerFusedLinearGRPOFunction.ppo_loss_fn(
        per_token_logps=logprobs64(hidden, weight, batch["ids"], bias),
        attention_mask=batch["mask"],
        advantages=batch["advantages"].double(),
        full_attention_mask=batch["mask"],
        ref_per_token_logps=ref,
        old_per_token_logps=batch["old"].double(),
        num_items_in_batch=num_items,
        **cfg,
    )
    loss.backward()
    return _result(loss, hidden, weight, bias)


def run_ours(batch, kwargs, dtype):
    hidden = batch["hidden"].to(dtype, copy=True).reshape(B * T, H).requires_grad_(True)
    weight = batch["weight"].to(dtype, copy=True).requires_grad_(True)
    bias = batch["bias"].to(dtype, copy=True).requires_grad_(True) if batch["bias"] is not None else None
    mask = batch["mask"].bool()
    targets = torch.where(mask, batch["ids"], -100).reshape(-1)  # padding: ignore_index
    logp = rk.linear_logprobs(hidden, weight, targets, temperature=TEMPERATURE, bias=bias).logp.view(B, T)
    ref = None
    if kwargs["options"].kl is not None:
        with torch.no_grad():
            ref_hidden = batch["ref_hidden"].to(dtype).reshape(B * T, H)
            ref = rk.linear_logprobs(ref_hidden, batch["ref_weight"].to(dtype), targets, temperature=TEMPERATURE)
            ref = ref.logp.view(B, T)
    loss, metrics = rk.policy_loss(
        logp, batch["old"].to(dtype), batch["advantages"].to(dtype), mask, ref_logprobs=ref, **kwargs
    )
    loss.backward()
    return _result(loss, hidden, weight, bias, hidden_shape=(B, T, H)), metrics


def _result(loss, hidden, weight, bias, hidden_shape=(B, T, H)):
    out = {"loss": loss.detach(), "grad.hidden": hidden.grad.view(hidden_shape), "grad.weight": weight.grad}
    if bias is not None:
        out["grad.bias"] = bias.grad
    return out


def check_case(batch, loss_type, beta, bias_kl, delta=None, chunk_size=1, num_items=None):
    cfg = liger_config(loss_type, beta, bias_kl, delta)
    kwargs = ours_config(loss_type, beta, bias_kl, delta)
    if num_items is not None:  # Liger's dapo / cispo divide by num_items_in_batch instead
        kwargs["global_num_tokens"] = num_items
    liger, liger_metrics = run_liger(batch, cfg, chunk_size, num_items)
    ref64 = run_liger64(batch, cfg, num_items)
    ours, metrics = run_ours(batch, kwargs, torch.float32)
    ours64, _ = run_ours(batch, kwargs, torch.float64)
    assert ours.keys() == liger.keys() == ref64.keys()
    for name in ref64:
        assert ours[name].dtype == liger[name].dtype == torch.float32, name
        # float32: the project's rule against Liger's formula in float64.
        c = compare(name, ours[name], ref64[name], liger[name], torch.float32)
        assert c.ok, (loss_type, beta, bias_kl, c)
        # float64: the same formula, to float64 rounding.
        torch.testing.assert_close(
            ours64[name], ref64[name], rtol=F64_RTOL, atol=F64_RTOL * float(ref64[name].abs().max()), msg=name
        )
    assert float(ref64["grad.weight"].abs().max()) > 0  # (not vacuous)
    # The fully masked row gets no gradient on either side.
    assert not ours["grad.hidden"][2].any() and not liger["grad.hidden"][2].any()

    # Liger's metrics: [mean KL term (with beta)], fraction clipped (low side for A < 0,
    # high side for A > 0, over the valid tokens). Ours: the same means.
    clipped = metrics.pg_clipfrac_low + metrics.pg_clipfrac_high
    expected = ([metrics.kl] if beta else []) + [clipped]
    assert len(liger_metrics) == len(expected)
    for theirs, mine in zip(liger_metrics, expected):
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=1e-5, atol=1e-6)
    return metrics


@pytest.mark.parametrize("beta,bias_kl", KL_CASES, ids=["no_kl", "k3", "k3_bias_corrected"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_liger_grpo_loss(loss_type, beta, bias_kl):
    """Loss, d/d hidden, d/d weight and Liger's metrics of every matched loss type."""
    metrics = check_case(make_batch(), loss_type, beta, bias_kl)
    if loss_type in ("dapo", "bnpo", "grpo", "dr_grpo"):
        # The batch exercises both clip sides.
        assert float(metrics.pg_clipfrac_low) > 0 and float(metrics.pg_clipfrac_high) > 0
    elif loss_type == "cispo":
        assert float(metrics.pg_clipfrac_high) > 0  # ratios above ε_high with A > 0


@pytest.mark.parametrize("loss_type,num_items", [("dapo", 40), ("grpo", None)])
def test_liger_delta_bias_chunks(loss_type, num_items):
    """Liger's two-sided clip ``delta`` (> 1 + ε_high) as our dual clip ``clip_ratio_c``,
    an LM-head bias (its gradient too), another seed, two rows per Liger chunk, and for
    ``dapo`` TRL's ``num_items_in_batch`` (the generation batch's token count) as our
    ``global_num_tokens``."""
    delta = 1.5
    batch = make_batch(seed=1, bias=True)
    metrics = check_case(batch, loss_type, 0.04, True, delta=delta, chunk_size=2, num_items=num_items)
    assert float(metrics.pg_clipfrac_lower) > 0  # the dual clip is active somewhere
