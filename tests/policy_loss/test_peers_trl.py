"""``grpo_loss_trl`` against TRL's own ``GRPOTrainer._compute_loss``, on every backend.

TRL computes the loss inline, so the test takes TRL's real source at test time:
``inspect.getsource(GRPOTrainer._compute_loss)`` from the line after the model forward
(``if self.top_entropy_quantile < 1.0:``) to its ``return loss``, dedented into a function
of ``(self, inputs, per_token_logps, entropies, mask, aux_loss)`` and run with a stand-in
``self`` carrying the trainer's attributes (``get_high_entropy_mask`` is TRL's real method
bound to it; the accelerator is one process: gather / reduce / pad are the identity). If
TRL moves or rewrites the block, the markers stop matching and the tests fail (never
skip), naming the TRL version.

Each case runs TRL and ours on copies of the same fp32 batch (B in 6..16, T in 20..50,
ragged completion mask with an empty row, advantages of both signs, log-ratios that clip
on both sides and pass TRL's ``delta``) and compares the loss and its gradient w.r.t.
``per_token_logps`` and ``entropies`` (atol 1e-6, rtol 1e-5), and every metric TRL logs
(``grpo_loss_trl(..., return_trl_metrics=True)`` reduced by ``reduce_trl_metrics``: the same
names, the same values, NaN where TRL's is NaN).
TRL computes in float32; where its own rounding exceeds the tolerance (sums that cancel),
its code is also run in float64 and ours is held to that (``close``).
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import types
from collections import defaultdict

import pytest
import torch
import trl
from _backends import ALL
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from rlvr_kernels.integrations.trl import grpo_loss_trl
from rlvr_kernels.integrations.trl.grpo_trainer import reduce_trl_metrics

ATOL, RTOL = 1e-6, 1e-5
START = "if self.top_entropy_quantile < 1.0:"
END = "return loss"
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
CLIPPED = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]


@functools.lru_cache(maxsize=None)
def trl_loss_fn():
    where = "trl.trainer.grpo_trainer.GRPOTrainer._compute_loss"
    lines = inspect.getsource(GRPOTrainer._compute_loss).splitlines()
    first = [i for i, line in enumerate(lines) if line.strip() == START]
    if len(first) != 1:
        pytest.fail(
            f"TRL {trl.__version__}: expected one line {START!r} in {where}, found {len(first)}; "
            f"TRL's loss code moved, update tests/policy_loss/test_peers_trl.py"
        )
    last = [i for i in range(first[0], len(lines)) if lines[i].strip() == END]
    if not last:
        pytest.fail(
            f"TRL {trl.__version__}: no {END!r} after {START!r} in {where}; update tests/policy_loss/test_peers_trl.py"
        )
    body = textwrap.dedent("\n".join(lines[first[0] : last[0] + 1]))
    text = "def trl_loss(self, inputs, per_token_logps, entropies, mask, aux_loss):\n" + textwrap.indent(body, "    ")
    namespace = dict(torch=torch, nanmin=nanmin, nanmax=nanmax)
    exec(compile(text, f"<TRL {trl.__version__} {where}>", "exec"), namespace)
    return namespace["trl_loss"], body


def trl_self(c: dict):
    """The trainer attributes ``_compute_loss`` reads, for one process."""
    accelerator = types.SimpleNamespace(
        num_processes=c["num_processes"],
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        reduce=lambda t, reduction="sum": t,
        pad_across_processes=lambda t, dim=0, pad_index=0: t,
        sync_gradients=True,
    )
    args = types.SimpleNamespace(
        use_bias_correction_kl=c["bias_kl"],
        delta=c["delta"],
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=c["vespo_k_neg"],
        vespo_lambda_neg=2.0,
        steps_per_generation=c["spg"],
        sapo_temperature_pos=c["tau_pos"],
        sapo_temperature_neg=c["tau_neg"],
    )
    self = types.SimpleNamespace(
        top_entropy_quantile=c["top_entropy_quantile"],
        off_policy_mask_threshold=c["opsm"],
        importance_sampling_level=c["level"],
        beta=c["beta"],
        args=args,
        loss_type=c["loss_type"],
        epsilon_low=c["eps_low"],
        epsilon_high=c["eps_high"],
        use_vllm=c["is_ratio"] is not None,
        vllm_importance_sampling_correction=c["is_ratio"] is not None,
        model=types.SimpleNamespace(training=c["training"]),
        current_gradient_accumulation_steps=c["ga"],
        max_completion_length=c["max_len"],
        accelerator=accelerator,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _entropy_bonus_enabled=c["entropy_coef"] != 0.0,
        entropy_coef=c["entropy_coef"],
        use_adaptive_entropy=False,
        aux_loss_enabled=False,
    )
    self.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, self)
    self.get_off_policy_mask = GRPOTrainer.get_off_policy_mask  # (static methods)
    self.get_gamma_weights = GRPOTrainer.get_gamma_weights
    return self


# ---------------------------------------------------------------------------------------
# Batches and cases
# ---------------------------------------------------------------------------------------


def make_batch(seed: int, device="cpu") -> dict:
    gen = torch.Generator().manual_seed(seed)
    B = int(torch.randint(6, 17, (), generator=gen))
    T = int(torch.randint(20, 51, (), generator=gen))
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[int(torch.randint(1, B, (), generator=gen))] = 0  # an empty row
    lengths[0] = T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # TRL's completion_mask is int
    old = -torch.rand(B, T, generator=gen) * 3 - 0.05
    delta = torch.randn(B, T, generator=gen) * 0.6
    far = torch.rand(B, T, generator=gen) < 0.08
    jump = torch.randn(B, T, generator=gen).sign() * (1.3 + torch.rand(B, T, generator=gen) * 2)
    delta = torch.where(far, jump, delta)
    adv = torch.randn(B, generator=gen)
    adv[0], adv[1] = abs(float(adv[0])) + 0.1, -abs(float(adv[1])) - 0.1
    logp = old + delta
    ref = logp + torch.randn(B, T, generator=gen) * 0.5
    sampling_gap = 0.15 * torch.randn(B, T, generator=gen)
    sampling_gap = torch.where(
        torch.rand(B, T, generator=gen) < 0.06, 1.2 * torch.randn(B, T, generator=gen), sampling_gap
    )
    out = dict(
        per_token_logps=logp,
        old_per_token_logps=old,
        advantages=adv,
        completion_mask=mask,
        ref_per_token_logps=ref,
        entropies=torch.rand(B, T, generator=gen) * 2,
        sampling_gap=sampling_gap,
        num_items=torch.tensor(int(mask.sum()) * 3 + 5),
    )
    return {k: v.to(device) for k, v in out.items()}


def is_ratio(batch, mode):
    """TRL's vLLM importance-sampling ratio (computed as TRL's generation step does)."""
    if mode is None:
        return None
    diff = batch["sampling_gap"] * batch["completion_mask"]
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    r = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(r, max=2.0)
    return r.masked_fill((r < 0.5) | (r > 2.0), 0.0)


def make_case(k: int, loss_type: str, level: str) -> dict:
    """Case k of a loss type: features switched on by k so each appears in several cases."""
    clipped = loss_type in CLIPPED
    return dict(
        loss_type=loss_type,
        level=level,
        eps_low=0.2,
        eps_high=(2.5 if k % 5 else 0.9) if loss_type == "cispo" else (0.28 if k % 2 else 0.2),
        delta=(2.0, 1.1, 1.28)[k % 3] if clipped and k % 4 != 3 else None,
        beta=0.04 if k % 2 == 0 else 0.0,
        bias_kl=k % 4 != 2,  # TRL's default True
        opsm=(None, 0.05, 0.5)[k % 3],
        sampling=k % 5 == 2,
        vespo_k_neg=3.0 if k % 2 else 1.5,
        tau_pos=1.0 if k % 2 else 1.3,
        tau_neg=1.05 if k % 2 else 0.9,
        top_entropy_quantile=(1.0, 0.2, 1.0, 0.5, 0.3)[k % 5],
        entropy_coef=(0.0, 0.0, 0.01, 0.03)[k % 4] if k % 5 else 0.01,
        is_ratio=(None, "token_truncate", "sequence_truncate", None, "token_mask", "sequence_mask")[k % 6],
        ga=(1, 4, 2)[k % 3],
        num_processes=1 if (k % 4) in (1, 3) else (1, 2)[k % 2],
        spg=(1, 2, 4)[k % 3],
        training=k % 7 != 3,
        max_len=64,
        old_given=k % 8 != 5,
        validate=k % 5 != 4,  # (without the value checks zero IS ratios are not looked for)
        adv_shape=("B", "B1", "BT")[k % 3],
    )


def case_grid(loss_type):
    return [make_case(k, loss_type, level) for level in ("token", "sequence") for k in range(12)]


def subsample(backend, device, cases):
    """Every case, except on Triton's CPU interpreter (seconds per kernel call): one case."""
    cases = list(cases)
    if backend == "triton" and device == "cpu":
        return cases[len(cases) // 2 : len(cases) // 2 + 1]
    return cases


# ---------------------------------------------------------------------------------------
# Running both
# ---------------------------------------------------------------------------------------


def advantages_as(batch, shape):
    adv = batch["advantages"]
    if shape == "B1":
        return adv[:, None].clone()
    if shape == "BT":
        noise = torch.randn(batch["per_token_logps"].shape, generator=torch.Generator().manual_seed(3))
        return adv[:, None] + 0.3 * noise.to(adv.device)
    return adv.clone()


def run_trl(batch, c):
    fn, _ = trl_loss_fn()
    self = trl_self(c)
    lp = batch["per_token_logps"].clone().requires_grad_(True)
    ent = batch["entropies"].clone().requires_grad_(True)
    inputs = dict(
        advantages=advantages_as(batch, c["adv_shape"]),
        num_items_in_batch=batch["num_items"].clone(),
        ref_per_token_logps=batch["ref_per_token_logps"].clone(),
    )
    if c["old_given"]:
        inputs["old_per_token_logps"] = batch["old_per_token_logps"].clone()
    ratio = is_ratio(batch, c["is_ratio"])
    if ratio is not None:
        inputs["importance_sampling_ratio"] = ratio
    if c["sampling"]:
        inputs["sampling_per_token_logps"] = sampling_logps(batch)
    loss = fn(self, inputs, lp, ent, batch["completion_mask"].clone(), None)
    loss.backward()
    metrics = {k: v[0] for k, v in self._metrics["train" if c["training"] else "eval"].items()}
    metrics.pop("entropy_coef", None)  # the trainer's controller state, not the loss's
    return loss, lp.grad, ent.grad, metrics


def sampling_logps(batch):
    """vLLM's log-probs for the off-policy mask: the old ones shifted by the sampling gap."""
    return batch["old_per_token_logps"] - batch["sampling_gap"]


def run_ours(batch, c, backend):
    lp = batch["per_token_logps"].clone().requires_grad_(True)
    ent = batch["entropies"].clone().requires_grad_(True)
    loss, m, trl_metrics = grpo_loss_trl(
        lp,
        batch["old_per_token_logps"].clone() if c["old_given"] else None,
        advantages_as(batch, c["adv_shape"]),
        batch["completion_mask"].clone(),
        loss_type=c["loss_type"],
        epsilon_low=c["eps_low"],
        epsilon_high=c["eps_high"],
        delta=c["delta"],
        importance_sampling_level=c["level"],
        beta=c["beta"],
        ref_per_token_logps=batch["ref_per_token_logps"].clone(),
        use_bias_correction_kl=c["bias_kl"],
        sapo_temperature_pos=c["tau_pos"],
        sapo_temperature_neg=c["tau_neg"],
        top_entropy_quantile=c["top_entropy_quantile"],
        entropies=ent,
        entropy_coef=c["entropy_coef"],
        importance_sampling_ratio=is_ratio(batch, c["is_ratio"]),
        off_policy_mask_threshold=c["opsm"],
        sampling_per_token_logps=sampling_logps(batch) if c["sampling"] else None,
        vespo_k_neg=c["vespo_k_neg"],
        max_completion_length=c["max_len"],
        num_items_in_batch=batch["num_items"].clone(),
        gradient_accumulation_steps=c["ga"],
        num_processes=c["num_processes"],
        steps_per_generation=c["spg"],
        training=c["training"],
        return_trl_metrics=True,
        validate=c["validate"],
        backend=backend,
    )
    loss.backward()
    assert m.num_tokens == float(batch["completion_mask"].sum())
    return loss, lp.grad, ent.grad, reduce_trl_metrics(trl_metrics)


def close(mine, v32, v64, what):
    """``mine`` against TRL's float32 result ``v32`` and float64 result ``v64`` (tensors or
    floats): within the tolerance of the float64 result widened by twice TRL's own float32
    rounding, and within the tolerance of the float32 result wherever that rounding is
    below a quarter of it (as tests/policy_loss/test_peers_verl.py)."""
    if isinstance(v32, torch.Tensor):
        assert isinstance(mine, torch.Tensor), what
        assert mine.dtype == v32.dtype, f"{what}: dtype {mine.dtype} != TRL's {v32.dtype}"
        assert mine.shape == v32.shape, f"{what}: shape {tuple(mine.shape)} != TRL's {tuple(v32.shape)}"
        m, a, e = mine.detach().double().cpu(), v32.detach().double().cpu(), v64.detach().double().cpu()
    else:
        m, a, e = (torch.tensor(float(x), dtype=torch.float64) for x in (mine, v32, v64))
        if bool(a.isnan()) or bool(m.isnan()):
            assert bool(a.isnan()) and bool(m.isnan()), f"{what}: ours {float(m)} vs TRL's {float(a)}"
            return
    tol = ATOL + RTOL * e.abs()
    trl_err = (a - e).abs()
    excess = (m - e).abs() - tol - 2 * trl_err
    assert not (excess > 0).any(), (
        f"{what}: ours differs from TRL's float64 result by {float(excess.max()):.3g} beyond the tolerance"
    )
    if (trl_err <= tol / 4).all():
        torch.testing.assert_close(m, a, atol=ATOL, rtol=RTOL, msg=lambda msg: f"{what} vs TRL float32\n{msg}")


def compare(mine, t32, t64, c):
    what = f"case {c}"
    close(mine[0], t32[0], t64[0], what + " loss")
    close(mine[1], t32[1], t64[1], what + " grad per_token_logps")
    if t32[2] is None:
        assert mine[2] is None, what
    else:
        close(mine[2], t32[2], t64[2], what + " grad entropies")
    m, metrics32, metrics64 = dict(mine[3]), t32[3], t64[3]
    if "policy_loss" not in metrics32:  # TRL logs it only with its entropy bonus on
        m.pop("policy_loss")
    assert sorted(m) == sorted(metrics32), f"{what}: metric names {sorted(m)} != TRL's {sorted(metrics32)}"
    for name in m:
        close(m[name], metrics32[name], metrics64[name], f"{what}: metric {name}")


def check_case(batch, c, backend):
    """Ours vs TRL in float32; TRL also runs in float64 when ours is not already within the
    tolerance of its float32 result (see ``close``)."""
    mine = run_ours(batch, c, backend)
    t32 = run_trl(batch, c)
    try:
        compare(mine, t32, t32, c)
    except AssertionError:
        b64 = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
        compare(mine, t32, run_trl(b64, c), c)


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


def test_trl_block_found():
    """The markers still cut TRL's loss code (else every test below fails)."""
    _, body = trl_loss_fn()
    assert "coef_1 = torch.exp(log_importance_weights)" in body and "per_token_loss" in body
    assert "num_items_in_batch" in body and "current_gradient_accumulation_steps" in body


def test_batches_exercise_every_branch():
    """Both clip sides, ratios beyond delta = 2 with A < 0, an empty row, zero IS ratios."""
    for seed in range(4):
        b = make_batch(seed)
        ratio = (b["per_token_logps"] - b["old_per_token_logps"]).exp()
        valid = b["completion_mask"].bool()
        adv = b["advantages"][:, None].expand_as(ratio)
        assert ((ratio > 1.28) & (adv > 0) & valid).any() and ((ratio < 0.8) & (adv < 0) & valid).any()
        assert ((ratio > 2.0) & (adv < 0) & valid).any()
        assert (b["completion_mask"].sum(-1) == 0).any()
        assert (is_ratio(b, "token_mask")[valid] == 0).any()
    # Over the cases' batches: a zero IS ratio on a clipped token (TRL's clip metrics still
    # count it), and off-policy masks that drop sequences at both thresholds of the cases.
    zero_on_clipped, dropped = False, {0.05: 0, 0.5: 0}
    for seed in range(50, 62):
        b = make_batch(seed)
        ratio = (b["per_token_logps"] - b["old_per_token_logps"]).exp()
        adv = b["advantages"][:, None].expand_as(ratio)
        clipped = ((ratio > 1.28) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
        zero_on_clipped |= bool((clipped & b["completion_mask"].bool() & (is_ratio(b, "token_mask") == 0)).any())
        for threshold in dropped:
            keep = GRPOTrainer.get_off_policy_mask(
                b["advantages"][:, None], b["per_token_logps"], sampling_logps(b), b["completion_mask"], threshold
            )
            dropped[threshold] += int((keep == 0).sum())
    assert zero_on_clipped and all(dropped.values()), dropped


@pytest.mark.parametrize("backend,device", ALL)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_matches_trl(backend, device, loss_type):
    """Each TRL loss type at token and sequence level, with KL (bias-corrected or not),
    delta above, at and below 1 + ε_high, the off-policy mask (with and without vLLM's
    log-probs), the entropy-quantile mask, the entropy bonus, vLLM IS ratios of every mode,
    gradient accumulation, several processes, steps_per_generation, eval mode, missing
    old log-probs and [B] / [B, 1] / [B, T] advantages switched on across the cases."""
    for k, c in enumerate(subsample(backend, device, case_grid(loss_type))):
        if c["top_entropy_quantile"] < 1.0:
            c["num_processes"] = 1  # TRL's threshold over several processes: test_entropy_threshold_across_processes
        check_case(make_batch(50 * LOSS_TYPES.index(loss_type) + k, device), c, backend)


@pytest.mark.parametrize("backend,device", ALL)
def test_sequence_level_gradient_is_token_form(backend, device):
    """TRL's sequence-level ratio exp(mean δ) sends its gradient through the mean; the
    fused GSPO token form gives each token the same derivative (checked against TRL above
    too): here with a large log-ratio mean, beyond the clamp at 10 verl would apply."""
    batch = make_batch(9, device)
    batch["per_token_logps"] = batch["per_token_logps"].clone()
    batch["per_token_logps"][2] = batch["old_per_token_logps"][2] + 11.0  # log s = 11 > 10
    batch["advantages"][2] = -0.5
    c = make_case(0, "grpo", "sequence")
    c.update(delta=None, beta=0.0, top_entropy_quantile=1.0, entropy_coef=0.0, is_ratio=None, eps_high=1e9)
    check_case(batch, c, backend)


def test_not_fused_raise():
    b = make_batch(1)
    args = (b["per_token_logps"], b["old_per_token_logps"], b["advantages"], b["completion_mask"])
    cases = [
        dict(loss_type="dapo", delta=0.9, epsilon_high=0.28, num_items_in_batch=100),
        dict(loss_type="grpo", delta=1.0, epsilon_high=0.0),
    ]
    for kw in cases:
        with pytest.raises(NotImplementedError):
            grpo_loss_trl(*args, **kw)
    with pytest.raises(NotImplementedError, match="process_group"):
        grpo_loss_trl(*args, loss_type="bnpo", top_entropy_quantile=0.2, entropies=b["entropies"], num_processes=2)
    bad = torch.ones_like(b["per_token_logps"])
    bad[0, 0] = -1.0
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        grpo_loss_trl(*args, loss_type="bnpo", importance_sampling_ratio=bad)


# ---------------------------------------------------------------------------------------
# top_entropy_quantile over several processes (two gloo processes started here)
# ---------------------------------------------------------------------------------------

_MP_CASE = dict(make_case(3, "dapo", "token"), top_entropy_quantile=0.3, entropy_coef=0.02, num_processes=2)


def _run_two_processes(tmp_path, how, batches):
    import time

    import torch.multiprocessing as mp
    from _trl_entropy_mp import worker

    c = _MP_CASE
    kw = dict(
        loss_type=c["loss_type"],
        epsilon_high=c["eps_high"],
        beta=c["beta"],
        top_entropy_quantile=c["top_entropy_quantile"],
        entropy_coef=c["entropy_coef"],
        gradient_accumulation_steps=c["ga"],
        steps_per_generation=c["spg"],
    )
    args = (str(tmp_path / "init"), str(tmp_path), how, batches, kw)
    ctx = mp.start_processes(worker, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two gloo processes did not finish within 180 s")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("how", ["process_group", "threshold"])
def test_entropy_threshold_across_processes(tmp_path, how):
    """TRL's threshold is ``torch.quantile`` over every process's valid-token entropies
    (``pad_across_processes`` + ``gather``): two gloo processes, each with its own batch,
    against TRL's code on each batch with the gather returning both processes' entropies."""
    batches = [make_batch(70 + r) for r in range(2)]
    results = _run_two_processes(tmp_path, how, batches)
    locals_ = [b["entropies"][b["completion_mask"].bool()].float() for b in batches]
    longest = max(t.numel() for t in locals_)
    padded = [torch.cat([t, t.new_full((longest - t.numel(),), -1e9)]) for t in locals_]
    gathered = torch.cat(padded)
    for batch, got in zip(batches, results):
        c = _MP_CASE
        fn, _ = trl_loss_fn()
        self = trl_self(c)
        calls = iter([gathered])  # the first gather is get_high_entropy_mask's
        self.accelerator.gather = lambda t: next(calls, t)
        lp = batch["per_token_logps"].clone().requires_grad_(True)
        ent = batch["entropies"].clone().requires_grad_(True)
        inputs = dict(
            advantages=batch["advantages"].clone(),
            num_items_in_batch=batch["num_items"].clone(),
            ref_per_token_logps=batch["ref_per_token_logps"].clone(),
            old_per_token_logps=batch["old_per_token_logps"].clone(),
        )
        loss = fn(self, inputs, lp, ent, batch["completion_mask"].clone(), None)
        loss.backward()
        # TRL with this process's threshold only gives another gradient: the test sees the gather
        lp_local = batch["per_token_logps"].clone().requires_grad_(True)
        fn(trl_self(c), dict(inputs), lp_local, ent.detach().clone(), batch["completion_mask"].clone(), None).backward()
        assert not torch.allclose(lp_local.grad, lp.grad, atol=1e-4)
        torch.testing.assert_close(got["loss"], loss.detach(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["grad"], lp.grad, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got["grad_ent"], ent.grad, atol=ATOL, rtol=RTOL)


def test_reduce_trl_metrics_with_an_accelerator():
    """reduce_trl_metrics takes a real ``accelerate.Accelerator`` (its reduce / gather), as a
    trainer patch passes ``self.accelerator``: the same floats as without one (one process)."""
    from accelerate import Accelerator

    b = make_batch(4)
    _, _, trl_metrics = grpo_loss_trl(
        b["per_token_logps"],
        b["old_per_token_logps"],
        b["advantages"],
        b["completion_mask"],
        loss_type="grpo",
        beta=0.04,
        ref_per_token_logps=b["ref_per_token_logps"],
        entropies=b["entropies"],
        return_trl_metrics=True,
    )
    with_acc = reduce_trl_metrics(trl_metrics, Accelerator(cpu=True))
    assert with_acc == reduce_trl_metrics(trl_metrics)
    assert {"kl", "entropy", "clip_ratio/low_min", "clip_ratio/high_max"} <= set(with_acc)
