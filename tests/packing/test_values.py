"""pack_values / unpack: per-token values gathered into a pack's targets and scattered back,
against a brute-force loop over the samples, in both key modes, with gradients."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlvr_kernels.packing import TreePack, pack_prefix_tree, pack_values, unpack

pytestmark = pytest.mark.cpu_kernel

KEYS = ("token+next", "token")


def forest(seed: int):
    """Seeded samples: groups sharing prompts over a small vocabulary (nested sharing,
    duplicates, prefixes of other samples), multi-turn masks, empty completions, a trained
    first token (which gives no target)."""
    rng = random.Random(seed)
    samples, masks = [], []
    for _ in range(rng.randint(2, 5)):
        prompt = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        for _ in range(rng.randint(1, 4)):
            c = [rng.randrange(4) for _ in range(rng.randint(0, 7))]
            m = [0] * len(prompt) + [1] * len(c)
            if c and rng.random() < 0.4:  # an untrained tool turn inside the completion
                a = rng.randrange(len(c))
                for i in range(a, rng.randint(a, len(c))):
                    m[len(prompt) + i] = 0
            samples.append(prompt + c)
            masks.append(m)
    if rng.random() < 0.5:
        samples.append(list(samples[0]))  # a duplicate
        masks.append(list(masks[0]))
    samples.append([rng.randrange(4) for _ in range(3)])  # trained from its first token
    masks.append([1, 1, 1])
    return samples, masks


def targets(samples, masks):
    """The targets by definition: every trained position p >= 1, sample-major, ascending."""
    return [(b, p) for b, m in enumerate(masks) for p in range(1, len(m)) if m[p]]


def padded(rows, width, dtype=torch.float64, fill=float("nan")):
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def values_like(samples, seed, trailing=()):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((len(s),) + trailing, generator=g, dtype=torch.float64) for s in samples]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("seed", range(6))
def test_pack_values_against_a_loop(seed, key, device):
    samples, masks = forest(seed)
    pack = pack_prefix_tree(samples, completion_mask=masks, key=key).to(device)
    per_sample = [v.to(device) for v in values_like(samples, seed)]
    want = torch.stack([per_sample[b][p] for b, p in targets(samples, masks)])
    L = max(map(len, samples))
    # Padding is NaN: reading it would show.
    as_padded = torch.full((len(samples), L + 2), float("nan"), dtype=torch.float64, device=device)
    for b, v in enumerate(per_sample):
        as_padded[b, : len(v)] = v
    for given in (as_padded, per_sample, [v.cpu().numpy() for v in per_sample], [v.tolist() for v in per_sample]):
        got = pack_values(given, pack)
        assert got.device == pack.token_index.device
        torch.testing.assert_close(got.to(torch.float64), want, rtol=0, atol=0)


@pytest.mark.parametrize("key", KEYS)
def test_pack_values_matches_the_builders_old_log_probs(key):
    """The builder's own ``old_log_probs`` [M] and ``advantages`` [M] are pack_values of the
    per-token and per-sample inputs."""
    samples, masks = forest(3)
    old = values_like(samples, 7)
    adv = torch.randn(len(samples), generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    pack = pack_prefix_tree(samples, completion_mask=masks, old_log_probs=old, advantages=adv, key=key)
    torch.testing.assert_close(pack_values(old, pack).float(), pack.old_log_probs, rtol=0, atol=0)
    torch.testing.assert_close(pack_values(adv, pack).float(), pack.advantages, rtol=0, atol=0)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("seed", range(4))
def test_unpack_against_a_loop(seed, key, device):
    samples, masks = forest(10 + seed)
    pack = pack_prefix_tree(samples, completion_mask=masks, key=key).to(device)
    where = targets(samples, masks)
    values = torch.randn(len(where), 3, generator=torch.Generator().manual_seed(seed)).to(device)
    out, mask = unpack(values, pack, fill=-7.0)
    L = max(map(len, samples))
    want = torch.full((len(samples), L, 3), -7.0)
    want_mask = torch.zeros(len(samples), L, dtype=torch.bool)
    for m, (b, p) in enumerate(where):
        want[b, p] = values[m].cpu()
        want_mask[b, p] = True
    assert out.shape == (len(samples), L, 3) and out.dtype == values.dtype and out.device == values.device
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)
    assert torch.equal(mask.cpu(), want_mask)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("seed", range(4))
def test_round_trip(seed, key):
    """pack_values then unpack gives back each sample's values at its targets, ``fill``
    elsewhere; unpack then pack_values gives back the per-target values."""
    samples, masks = forest(20 + seed)
    pack = pack_prefix_tree(samples, completion_mask=masks, key=key)
    L = max(map(len, samples))
    full = padded(values_like(samples, seed), L, fill=0.0)
    out, mask = unpack(pack_values(full, pack), pack, fill=0.0)
    assert torch.equal(out, torch.where(mask, full, torch.zeros(())))
    lengths = torch.tensor([len(s) for s in samples])
    trained = padded(masks, L, dtype=torch.bool, fill=False)
    trained[:, 0] = False  # a first token has no predecessor to score it
    assert torch.equal(mask, trained & (torch.arange(L) < lengths[:, None]))
    per_target = torch.randn(pack.num_targets, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(pack_values(unpack(per_target, pack)[0], pack), per_target)


def test_trailing_dims_and_per_sample_values():
    samples, masks = forest(31)
    pack = pack_prefix_tree(samples, completion_mask=masks)
    where = targets(samples, masks)
    per_sample = values_like(samples, 2, trailing=(2, 3))
    got = pack_values(per_sample, pack)
    assert got.shape == (len(where), 2, 3)
    assert torch.equal(got, torch.stack([per_sample[b][p] for b, p in where]))
    full = torch.zeros(len(samples), max(map(len, samples)) + 1, 2, 3, dtype=torch.float64)
    for b, v in enumerate(per_sample):
        full[b, : len(v)] = v
    assert torch.equal(pack_values(full, pack), got)
    # One value per sample (GRPO advantages): each target takes its sample's.
    adv = torch.arange(len(samples), dtype=torch.float32)
    assert pack_values(adv, pack).tolist() == [float(b) for b, _ in where]


@pytest.mark.parametrize("key", KEYS)
def test_gradients_flow(key):
    samples, masks = forest(41)
    pack = pack_prefix_tree(samples, completion_mask=masks, key=key)
    L = max(map(len, samples))
    where = targets(samples, masks)
    full = torch.randn(len(samples), L, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    full.requires_grad_(True)
    torch.autograd.gradcheck(lambda x: pack_values(x, pack), (full,))
    weights = torch.randn(pack.num_targets, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (pack_values(full, pack) * weights).sum().backward()
    want = torch.zeros(len(samples), L, dtype=torch.float64)
    for m, (b, p) in enumerate(where):
        want[b, p] = weights[m]
    assert torch.equal(full.grad, want)

    per_target = torch.randn(pack.num_targets, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda v: unpack(v, pack, fill=3.0)[0], (per_target,))
    parts = [v.requires_grad_(True) for v in values_like(samples, 5)]
    pack_values(parts, pack).sum().backward()
    for b, v in enumerate(parts):
        assert v.grad.tolist() == [1.0 if (b, p) in where else 0.0 for p in range(len(v))]


def test_empty_pack():
    pack = pack_prefix_tree([[5], []], completion_start=0)
    assert pack.num_targets == 0
    out, mask = unpack(torch.zeros(0), pack)
    assert out.shape == mask.shape == (2, 1) and not mask.any()
    assert pack_values(torch.ones(2, 1), pack).shape == (0,)
    assert pack_values([[1.0], []], pack).shape == (0,)
    none = pack_prefix_tree([], completion_start=0)
    out, mask = unpack(torch.zeros(0), none)
    assert out.shape == mask.shape == (0, 0)
    assert pack_values([], none).shape == pack_values(torch.zeros(0, 0), none).shape == (0,)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda p: unpack(torch.zeros(3), object()), TypeError, "pack"),
        (lambda p: unpack([0.0] * p.num_targets, p), TypeError, "values"),
        (lambda p: unpack(torch.zeros(p.num_targets + 1), p), ValueError, "values"),
        (lambda p: unpack(torch.zeros(()), p), ValueError, "values"),
        (lambda p: unpack(torch.zeros(p.num_targets), p, fill="x"), TypeError, "fill"),
        (lambda p: unpack(torch.zeros(p.num_targets, device="meta"), p), ValueError, "values"),
        (lambda p: pack_values(torch.zeros(3, 5), object()), TypeError, "pack"),
        (lambda p: pack_values(torch.zeros(3, 3), p), ValueError, "values"),
        (lambda p: pack_values(torch.zeros(2, 5), p), ValueError, "values"),
        (lambda p: pack_values(torch.zeros(4), p), ValueError, "values"),
        (lambda p: pack_values(torch.zeros(3, 5, device="meta"), p), ValueError, "values"),
        (lambda p: pack_values(5.0, p), TypeError, "values"),
        (lambda p: pack_values("abc", p), TypeError, "values"),
        (lambda p: pack_values([[0.0] * 4, [0.0] * 2], p), ValueError, "values"),
        (lambda p: pack_values([[0.0] * 4, [0.0] * 3, [0.0] * 4], p), ValueError, r"values\[1\]"),
        (lambda p: pack_values([[0.0] * 4, [0.0] * 2, 1.0], p), ValueError, r"values\[2\]"),
        (lambda p: pack_values([[0.0] * 4, [0.0] * 2, ["a"] * 5], p), TypeError, r"values\[2\]"),
        (lambda p: pack_values([np.zeros(4), np.zeros((2, 2)), np.zeros(5)], p), ValueError, "trailing"),
        (
            lambda p: pack_values([torch.zeros(4), torch.zeros(2, device="meta"), torch.zeros(5)], p),
            ValueError,
            "values",
        ),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    pack = pack_prefix_tree([[1, 2, 3, 4], [1, 2], [1, 2, 5, 6, 7]], completion_start=1)
    assert isinstance(pack, TreePack)
    with pytest.raises(error, match=match):
        call(pack)
