"""``keep_targets=True`` with a sampling support (docs/logprobs.md, "Sampling support"): a
target outside its row's kept set joins it instead of getting −inf. Every backend against
the fp64 reference (which adds the targets to its [N, V] kept mask), against the same backend
given the union as an explicit support, rows without such a target unchanged bit for bit,
degenerate rows finite, and the argument checks."""

import math

import pytest
import torch
from _backends import FAST

import rlvr_kernels as rk
from rlvr_kernels.reference.logprobs import support_mask
from rlvr_kernels.testing import logits_case_from, random_logprobs_case
from rlvr_kernels.testing.logprobs import assert_matches_reference, logprobs_upstream, run_logprobs

# (name, random_logprobs_case kwargs, sampling kwargs): random targets, most of them outside
# the kept set of these filters.
CASES = [
    ("top-p 0.7", dict(), dict(top_p=0.7)),
    ("top-k 3, bias, per-row T", dict(bias=True, temperature="rows"), dict(top_k=3)),
    ("min-p 0.2, soft-cap", dict(), dict(min_p=0.2, softcap=4.0)),
    ("top-p 0.8, bf16 logits", dict(), dict(top_p=0.8, logits_precision="bf16")),
    ("top-p 0.6, tf32 logits, bias", dict(bias=True), dict(top_p=0.6, logits_precision="tf32")),
    ("top-k 2, row_index (repeated targets), ignored", dict(branching=True, ignore_fraction=0.2), dict(top_k=2)),
]


def _outside_fraction(inputs) -> float:
    """The share of the (non-ignored) targets that the support alone leaves out."""
    plain = {k: v for k, v in inputs.items() if k != "keep_targets"}
    out = run_logprobs(plain, "reference")["outside"]
    use = inputs["targets"].reshape(-1) != -100
    return float(out.reshape(-1)[use].double().mean())


def _repeat_a_target(inputs):
    """Two targets of one row on the same outside column (it joins the row once)."""
    if inputs.get("row_index") is None:
        return inputs
    t, r = inputs["targets"].clone(), inputs["row_index"]
    for k in range(1, t.shape[0]):
        if r[k] == r[k - 1] and t[k - 1] != -100:
            t[k] = t[k - 1]
            break
    return {**inputs, "targets": t}


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_linear_matches_reference(backend, device, case):
    name, kw, sampling = case
    gen = torch.Generator().manual_seed(len(name) * 7)
    inputs = random_logprobs_case(gen, N=17, H=19, V=71, dtype=torch.float64, device=device, **kw)
    inputs = _repeat_a_target({**inputs, **sampling, "keep_targets": True})
    assert _outside_fraction(inputs) > 0.3, "the case must exercise the joined targets"
    assert_matches_reference(inputs, backend, gen)
    assert not bool(run_logprobs(inputs, backend)["outside"].any())


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("case", CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_from_logits_matches_reference(backend, device, case):
    name, kw, sampling = case
    sampling = {k: v for k, v in sampling.items() if k not in ("softcap", "logits_precision")}
    gen = torch.Generator().manual_seed(len(name) * 5)
    inputs = logits_case_from(random_logprobs_case(gen, N=14, H=15, V=83, dtype=torch.float64, device=device, **kw))
    inputs.update(sampling, keep_targets=True)
    assert _outside_fraction(inputs) > 0.3
    assert_matches_reference(inputs, backend, gen)


def _union_csr(inputs, sampling):
    """The kept set of ``sampling`` on the inputs' fp64 logits with every target added, as an
    explicit CSR support."""
    h, w = inputs["hidden"].double(), inputs["weight"].double()
    z = h @ w.T + (0 if inputs.get("bias") is None else inputs["bias"].double())
    t = inputs.get("temperature", 1.0)
    z = z / (t.double()[:, None] if isinstance(t, torch.Tensor) else t)
    kept = support_mask(z.shape[0], z.shape[1], z.device, z=z, **sampling)
    rows = torch.arange(z.shape[0]) if inputs.get("row_index") is None else inputs["row_index"].long()
    use = inputs["targets"] != -100
    kept[rows[use], inputs["targets"][use].long()] = True
    ids = kept.nonzero()[:, 1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), kept.sum(-1).cumsum(0)])
    return ids, offsets


@pytest.mark.parametrize("backend,device", FAST)
@pytest.mark.parametrize("fp32", [False, True], ids=["fp64", "fp32"])
def test_equals_the_union_as_explicit_support(backend, device, fp32):
    """keep_targets on computed filters gives what the same backend gives for the explicit
    support kept ∪ targets: the joined targets' terms (ops layer) against the kernels' own."""
    gen = torch.Generator().manual_seed(41)
    inputs = random_logprobs_case(gen, N=21, H=24, V=97, dtype=torch.float64, branching=True, ignore_fraction=0.1)
    inputs["hidden"] = inputs["hidden"] * 2  # peaked rows: small kept sets
    sampling = dict(top_p=0.75, top_k=9)
    ids, offsets = _union_csr(inputs, sampling)
    if fp32:
        inputs = {
            k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()
        }
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    up = logprobs_upstream(inputs, gen)
    kept = run_logprobs({**inputs, **sampling, "keep_targets": True}, backend, up)
    union = run_logprobs({**inputs, "support_ids": ids.to(device), "support_offsets": offsets.to(device)}, backend, up)
    tol = dict(rtol=1e-5, atol=1e-5) if fp32 else dict(rtol=1e-12, atol=1e-12)
    for key in ("logp", "entropy", "grad.hidden", "grad.weight"):
        torch.testing.assert_close(kept[key], union[key], **tol, msg=key)
    assert not bool(union["outside"].any())


@pytest.mark.parametrize("backend,device", FAST)
def test_rows_without_outside_targets_are_unchanged(backend, device):
    """Targets inside the support (each row's argmax): keep_targets changes no bit of the
    log-probs, the entropies or the gradients."""
    gen = torch.Generator().manual_seed(3)
    inputs = random_logprobs_case(gen, N=13, H=16, V=61, bias=True, device=device)
    z = inputs["hidden"] @ inputs["weight"].T + inputs["bias"]
    inputs["targets"] = z.argmax(-1)
    up = logprobs_upstream(inputs, gen)
    plain = run_logprobs({**inputs, "top_p": 0.8}, backend, up)
    kept = run_logprobs({**inputs, "top_p": 0.8, "keep_targets": True}, backend, up)
    for key in ("logp", "entropy", "grad.hidden", "grad.weight", "grad.bias"):
        assert torch.equal(plain[key], kept[key]), key


@pytest.mark.parametrize("backend,device", FAST)
def test_degenerate_rows_are_finite(backend, device):
    """An empty explicit row whose target joins it (log-prob 0, entropy 0, no gradient), a
    −inf logit target (stays outside: −inf), an ignored target, a row of ties."""
    n, v = 4, 9
    logits = torch.randn(n, v, dtype=torch.float64)
    logits[2, 5] = float("-inf")
    logits[3] = 1.0
    logits = logits.to(device).requires_grad_(True)
    targets = torch.tensor([3, 4, 5, -100], device=device)
    ids = torch.tensor([0, 1, 0, 1, 2], device=device)
    offsets = torch.tensor([0, 2, 2, 4, 5], device=device)  # row 1 empty
    out = rk.logprobs_from_logits(
        logits,
        targets,
        return_entropy=True,
        support_ids=ids,
        support_offsets=offsets,
        keep_targets=True,
        backend=backend,
    )
    assert out.logp[1].item() == 0.0 and out.entropy[1].item() == 0.0
    assert math.isinf(out.logp[2].item()) and bool(out.outside_support[2]) and not bool(out.outside_support[:2].any())
    assert out.logp[3].item() == 0.0
    assert bool(torch.isfinite(out.logp[:2]).all()) and bool(torch.isfinite(out.entropy).all())
    (torch.where(out.outside_support, 0.0, out.logp).sum() + out.entropy.sum()).backward()
    assert bool(torch.isfinite(logits.grad[:, :5]).all()) and bool((logits.grad[1] == 0).all())
    ref = rk.logprobs_from_logits(
        logits.detach(),
        targets,
        return_entropy=True,
        support_ids=ids,
        support_offsets=offsets,
        keep_targets=True,
        backend="reference",
    )
    torch.testing.assert_close(out.logp.detach(), ref.logp, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.entropy.detach(), ref.entropy, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "kw,err,word",
    [
        (dict(keep_targets=1, top_p=0.9), TypeError, "keep_targets"),
        (dict(keep_targets=True), ValueError, "keep_targets"),
    ],
)
def test_bad_arguments_raise(kw, err, word):
    h, w, t = torch.randn(3, 4), torch.randn(7, 4), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(err, match=word):
        rk.linear_logprobs(h, w, t, **kw)
    with pytest.raises(err, match=word):
        rk.logprobs_from_logits(h @ w.T, t, **kw)
