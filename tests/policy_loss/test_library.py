"""The torch.library contract of policy_loss: opcheck (schema, fake kernel, registered
autograd), torch.compile(fullgraph=True), and gradcheck in fp64 for every loss type."""

import importlib

import pytest
import torch
from _backends import FAST, HEAVY

import rlvr_kernels as rk
from rlvr_kernels import TokenShaping
from rlvr_kernels.contracts.policy_loss import TokenOut
from rlvr_kernels.testing import random_policy_case

ops = importlib.import_module("rlvr_kernels.ops.policy_loss")


def op_args(device, backend, layout, agg="token-mean", token_out=TokenOut.NONE, need_entropy_grad=True):
    gen = torch.Generator().manual_seed(0)
    inputs = random_policy_case(gen, B=7, L=13, layout=layout, device=device)
    opts = rk.PolicyLossOptions(
        kl="k3",
        kl_coef=0.1,
        rollout_correction="seq_tis",
        entropy_coef=0.01,
        agg=agg,
        shaping=TokenShaping(probability=0.5, entropy_quantile=0.5),
    )
    x = ops._validate(
        inputs["logprobs"],
        inputs["old_logprobs"],
        inputs["advantages"],
        inputs["mask"],
        inputs["ref_logprobs"],
        inputs["rollout_logprobs"],
        inputs["entropy"],
        inputs.get("cu_seqlens"),
        opts,
        True,
    )
    fparams, iparams = ops._kernel_params(opts, x.seq_adv, token_out).pack()
    return ops._FwdArgs(
        logprobs=x.logprobs.detach().requires_grad_(True),
        old_logprobs=x.old_logprobs,
        advantages=x.advantages,
        mask=x.mask,
        ref_logprobs=x.ref_logprobs,
        rollout_logprobs=x.rollout_logprobs,
        entropy=x.entropy.detach().requires_grad_(need_entropy_grad),
        cu_seqlens=x.cu_seqlens,
        entropy_threshold=x.entropy_threshold,
        fparams=fparams,
        iparams=iparams,
        need_entropy_grad=need_entropy_grad,
        backend=backend,
    )


def test_autograd_binds_the_op_arguments_by_name():
    schema = torch.ops.rlvr_kernels.policy_loss_fwd.default._schema
    assert tuple(a.name for a in schema.arguments) == ops._FwdArgs._fields


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("token_out", [TokenOut.NONE, TokenOut.LOSS])
def test_opcheck(backend, device, layout, token_out):
    torch.library.opcheck(ops._policy_loss_fwd, tuple(op_args(device, backend, layout, token_out=token_out)))


@pytest.mark.cpu_kernel
def test_fake_kernel_shapes_match_real_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for need in (True, False):
        args = tuple(op_args("cpu", "cpu", "padded", token_out=TokenOut.LOSS, need_entropy_grad=need))
        real = ops._policy_loss_fwd(*args)
        with FakeTensorMode() as mode:
            fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            fake = ops._policy_loss_fwd(*fake_args)
        for r, f in zip(real, fake):
            assert r.shape == f.shape and r.dtype == f.dtype


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_torch_compile_fullgraph(backend, device, layout):
    gen = torch.Generator().manual_seed(1)
    inputs = random_policy_case(gen, B=16, L=24, layout=layout, device=device)
    n_tok = inputs["mask"].sum()

    def step(logprobs, old, adv, mask, ref, roll, cu):
        loss, met = rk.policy_loss(
            logprobs,
            old,
            adv,
            mask,
            preset="verl",
            kl="k3",
            kl_coef=0.1,
            kl_ratio_correction=True,
            ref_logprobs=ref,
            rollout_correction="token_tis",
            rollout_logprobs=roll,
            cu_seqlens=cu,
            global_num_tokens=n_tok,
            backend=backend,
        )
        return loss * 2.0, torch.stack([met.pg_clipfrac, met.pg_clipfrac_low, met.seq_clipfrac_high_max])

    args = [inputs[k] for k in ("logprobs", "old_logprobs", "advantages", "mask", "ref_logprobs", "rollout_logprobs")]
    args.append(inputs.get("cu_seqlens"))
    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        lp = args[0].detach().clone().requires_grad_(True)
        loss, clipfrac = fn(lp, *args[1:])
        loss.backward()
        results.append((loss.detach(), clipfrac, lp.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend,device", HEAVY)
@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "cispo", "sapo", "reinforce"])
def test_gradcheck_fp64(backend, device, loss_type):
    """The registered backward is the derivative of the forward. CISPO and GSPO define
    their gradient through stop-gradients (sg(clip(ρ)), sg(log s_i)), so their value only
    has that derivative where the stopped part is constant: CISPO with every ratio
    outside the clip range, GSPO with weights uniform along a sequence (and no KL ratio
    correction: its token form s_{i,t} is not the derivative of the KL term times s_i)."""
    gen = torch.Generator().manual_seed(2)
    # Small log-ratios keep every token away from the kinks the finite differences would straddle.
    inputs = random_policy_case(gen, B=4, L=6, dtype=torch.float64, spread=0.05, device=device)
    old = inputs["old_logprobs"]
    shaping = TokenShaping(w_pos=0.5, probability=0.5, a3po_pos_high=(0.3, 2.0))
    correction = "token_tis"
    if loss_type == "cispo":
        side = torch.randint(0, 2, old.shape, generator=gen).to(device) * 2 - 1
        old = inputs["logprobs"] + 0.5 * side  # ρ = e^±0.5: always clipped
    if loss_type == "gspo":
        shaping, correction = None, "seq_tis"
    for agg, kl in (("token-mean", "k3"), ("seq-mean-token-mean", "k2"), ("none", "k1")):

        def f(lp, ent):
            loss, _ = rk.policy_loss(
                lp,
                old,
                inputs["advantages"],
                inputs["mask"],
                loss_type=loss_type,
                clip_ratio_c=3.0 if loss_type == "ppo" else None,
                kl=kl,
                kl_coef=0.1,
                kl_ratio_correction=loss_type != "gspo" and kl != "k1",
                ref_logprobs=inputs["ref_logprobs"],
                entropy=ent,
                entropy_coef=0.01,
                rollout_correction=correction,
                rollout_logprobs=inputs["rollout_logprobs"],
                shaping=shaping,
                agg=agg,
                backend=backend,
            )
            return loss

        lp = inputs["logprobs"].detach().clone().requires_grad_(True)
        ent = inputs["entropy"].detach().clone().double().requires_grad_(True)
        assert torch.autograd.gradcheck(f, (lp, ent), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm", "none"])
def test_meta_inputs_give_meta_outputs(layout, agg):
    """All-meta inputs run the fake kernels (no value check reads them): meta outputs of the
    right shapes and dtypes, forward and backward."""
    gen = torch.Generator().manual_seed(3)
    inputs = random_policy_case(gen, B=5, L=11, layout=layout, dtype=torch.bfloat16)
    meta = {k: v.to("meta") for k, v in inputs.items()}
    lp = meta["logprobs"].detach().requires_grad_(True)
    ent = meta["entropy"].detach().requires_grad_(True)
    extra = dict(loss_scale_factor=8.0) if layout == "packed" else {}
    loss, met = rk.policy_loss(
        **dict(meta, logprobs=lp, entropy=ent),
        kl="k3",
        kl_coef=0.1,
        rollout_correction="seq_tis",
        entropy_coef=0.01,
        agg=agg,
        shaping=TokenShaping(probability=0.5, entropy_quantile=0.5),
        **extra,
    )
    assert loss.device.type == "meta" and loss.dtype == torch.float32
    assert loss.shape == (lp.shape if agg == "none" else ())
    assert all(v.device.type == "meta" and v.shape == () for v in met)
    loss.sum().backward()
    assert lp.grad.shape == lp.shape and lp.grad.dtype == torch.bfloat16 and lp.grad.device.type == "meta"
    assert ent.grad.shape == ent.shape
    shaped = rk.shape_token_advantages(
        meta["advantages"],
        meta["old_logprobs"],
        meta["mask"],
        TokenShaping(a3po_pos_high=(0.2, 2.0), entropy_quantile=0.5),
        entropy=meta["entropy"],
        cu_seqlens=meta.get("cu_seqlens"),
    )
    assert shaped.device.type == "meta" and shaped.shape == lp.shape and shaped.dtype == torch.float32
