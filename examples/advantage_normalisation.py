"""One group of binary rewards: mean vs mean+std normalised advantages, then what a
token-level loss additionally needs (a response mask, token probabilities for shaping).

Prints plain-text tables, each value from the package's ops and checked against the plain
formula written out here:
  1. Dr.GRPO  A_i = r_i − mean(r)                 ``group_advantages(estimator="dr_grpo")``
     GRPO     A_i = (r_i − mean(r)) / (std(r) + ε) ``group_advantages(estimator="grpo")``
              (std with Bessel's correction, ε = 1e-6, the package's GRPO defaults)
  2. token advantages A_i·m_{i,t} for responses of different lengths (``response_mask``);
  3. per-token shaping of one correct and one wrong response from the old policy's token
     probabilities p_{i,t} (``shape_token_advantages``, docs/token-shaping.md): the seed's probability
     weights (λ = 1: Ã = A·(1 − p) for A > 0, A·p for A < 0) and A3PO's rank selection.

    .venv/bin/python examples/advantage_normalisation.py [--rewards 1,0,0,1,0,0,0,0] [--lengths 5,3,6,4,2,7,3,4]
"""

import argparse

import torch

import rlvr_kernels as rk

DEFAULT_REWARDS = "1,0,0,1,0,0,0,0"
DEFAULT_LENGTHS = (5, 3, 6, 4, 2, 7, 3, 4)  # cycled when the group is larger
EPS = 1e-6
# Illustrative A3PO knobs (ratio, scale): double the quarter of lowest-probability tokens of
# correct responses and the quarter of highest-probability tokens of wrong ones.
A3PO = rk.TokenShaping(a3po_pos_low=(0.25, 2.0), a3po_neg_high=(0.25, 2.0))
PROBABILITY = rk.TokenShaping(probability=1.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rewards", default=DEFAULT_REWARDS, help="comma-separated rewards of one group")
    ap.add_argument("--lengths", default=None, help="comma-separated response lengths (default: a fixed pattern)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the illustrative token probabilities")
    args = ap.parse_args(argv)

    rewards = torch.tensor(_floats(args.rewards, "--rewards"), dtype=torch.float64)
    B = rewards.numel()
    if B < 2:
        ap.error("--rewards: a group needs at least 2 rewards")
    if args.lengths is None:
        lengths = torch.tensor([DEFAULT_LENGTHS[i % len(DEFAULT_LENGTHS)] for i in range(B)])
    else:
        lengths = torch.tensor([int(x) for x in _floats(args.lengths, "--lengths")])
        if lengths.numel() != B or bool((lengths < 1).any()):
            ap.error(f"--lengths: expected {B} positive lengths, one per reward")
    L = int(lengths.max())
    mask = torch.arange(L)[None, :] < lengths[:, None]  # [B, L] response mask

    # ---- 1. the two normalisations, from the op and from the formula
    dr = rk.group_advantages(rewards, group_size=B, estimator="dr_grpo", out_dtype=torch.float64)
    grpo = rk.group_advantages(
        rewards, group_size=B, estimator="grpo", response_mask=mask, eps=EPS, out_dtype=torch.float64
    )
    mean, std = rewards.mean(), rewards.std(unbiased=True)
    _check("r − mean", dr.advantages, rewards - mean)
    _check("(r − mean)/(std + ε)", grpo.advantages, (rewards - mean) / (std + EPS))

    print(f"one group of {B} rewards: mean {float(mean):.4f}, std (Bessel) {float(std):.4f}")
    print("advantages")
    print(f"{'i':>3} {'reward':>7} {'r - mean':>10} {'(r - mean)/(std + eps)':>24}")
    for i in range(B):
        print(f"{i:>3} {rewards[i]:>7.3f} {dr.advantages[i]:>10.4f} {grpo.advantages[i]:>24.4f}")
    print(
        "mean only: A stays in reward units (success 1 − p̂, failure −p̂ for 0/1 rewards).\n"
        "mean+std: each group is rescaled to unit std, i.e. multiplied by 1/std: relative to mean only, a\n"
        "question almost always or almost never solved (small std) weighs more (the bias Dr.GRPO drops)."
    )
    if bool(grpo.group_degenerate[0]):
        print("this group is degenerate (all rewards equal): both give A = 0, it carries no signal.")

    # ---- 2. sequence advantage → tokens: needs the response mask
    _check("A_i · m_it", grpo.token_advantages, grpo.advantages[:, None] * mask)
    print("\ntoken advantages A_i · m_it (GRPO; '.' = padding beyond the response)")
    print(f"{'i':>3} {'len':>4}  " + " ".join(f"{'t=' + str(t):>7}" for t in range(L)))
    for i in range(B):
        cells = [f"{grpo.token_advantages[i, t]:>7.4f}" if mask[i, t] else f"{'.':>7}" for t in range(L)]
        print(f"{i:>3} {int(lengths[i]):>4}  " + " ".join(cells))
    print(
        "every token of a response gets the same A_i: the sequence-level signal cannot tell which\n"
        "tokens mattered. Token-level shaping adds that from the old policy's token probabilities."
    )

    # ---- 3. token probabilities and shaping
    pos = (grpo.advantages > 0).nonzero().flatten()
    neg = (grpo.advantages < 0).nonzero().flatten()
    if len(pos) == 0 or len(neg) == 0:
        print("\nno correct/wrong pair with non-zero advantages in this group: nothing to shape")
        return
    g = torch.Generator().manual_seed(args.seed)
    # Illustrative old-policy probabilities: mostly confident tokens with a few uncertain ones.
    probs = torch.sigmoid(2.0 * torch.randn(B, L, generator=g, dtype=torch.float64) + 1.0)
    old_logprobs = torch.where(mask, probs.log(), torch.zeros_like(probs))
    by_prob = rk.shape_token_advantages(grpo.advantages, old_logprobs, mask, PROBABILITY)
    by_a3po = rk.shape_token_advantages(grpo.advantages, old_logprobs, mask, A3PO)
    a = grpo.advantages[:, None]
    weight = torch.where(a > 0, 1 - probs, torch.where(a < 0, probs, torch.zeros_like(probs)))
    _check("A · w(p) (probability shaping, λ = 1)", by_prob, a * weight * mask)

    explain = {
        True: "correct response (A > 0): low-probability tokens keep most of A (w = 1 − p), confident ones "
        "little;\nA3PO doubles its ⌊n/4⌋ (at least 1) tokens of lowest probability.",
        False: "wrong response (A < 0): high-probability tokens keep most of the penalty (w = p), unlikely ones "
        "little;\nA3PO doubles its ⌊n/4⌋ (at least 1) tokens of highest probability.",
    }
    # The longest correct and wrong responses show the rank selection best.
    i_pos, i_neg = int(pos[lengths[pos].argmax()]), int(neg[lengths[neg].argmax()])
    for correct, i in ((True, i_pos), (False, i_neg)):
        print(
            f"\nshaped token advantages, sample {i} ({'correct' if correct else 'wrong'}, A = {grpo.advantages[i]:.4f})"
        )
        print(f"{'t':>3} {'p':>7} {'A':>9} {'A*w(p)':>9} {'A3PO':>9}")
        for t in range(int(lengths[i])):
            print(
                f"{t:>3} {probs[i, t]:>7.4f} {grpo.token_advantages[i, t]:>9.4f} "
                f"{by_prob[i, t]:>9.4f} {by_a3po[i, t]:>9.4f}"
            )
        print(explain[correct])


def _floats(text: str, name: str):
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name}: expected comma-separated numbers, got {text!r}") from None


def _check(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """The op's numbers equal the formula's (float64 throughout, so to rounding)."""
    torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


if __name__ == "__main__":
    main()
