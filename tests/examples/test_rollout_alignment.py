"""``examples/rollout_alignment.py`` at a tiny size: the emulated engine samples inside its kept
set and reports the log-probs of that set's softmax, and the claims of docs/rollout-alignment.md
hold on every backend: the matched trainer head (bf16 logits + the engine's top-p) agrees
better than every mismatched one, its residual lives only on the rows whose top-p boundary
splits a bf16 tie, and the engine's own kept set (support_ids) closes it."""

import dataclasses

import pytest
import torch

from rlvr_kernels.testing.sampling import vllm_kept

TINY = dict(vocab=1024, hidden=64, layers=1, batch=4, response_len=24)


@pytest.fixture(scope="module")
def rollout(ra):
    torch.set_num_threads(2)
    cfg = ra.Config(**TINY)
    return cfg, ra.simulate(cfg)


def test_engine_emulation(ra, rollout):
    cfg, ro = rollout
    n = cfg.batch * cfg.response_len
    assert ro["hidden"].shape == (n, cfg.hidden) and ro["tokens"].shape == (n,)
    rows = torch.arange(n)
    assert bool(ro["kept"][rows, ro["tokens"]].all()), "a token sampled outside the engine's kept set"
    z = (ro["hidden"].bfloat16() @ ro["weight"].bfloat16().T).float() / cfg.temperature
    assert torch.equal(ro["kept"], vllm_kept(z, top_p=cfg.top_p))
    expect = z.masked_fill(~ro["kept"], float("-inf")).log_softmax(-1)[rows, ro["tokens"]]
    assert torch.equal(ro["processed"], expect)
    # The kept set's softmax puts more mass on each kept token than the full one (T = 1 here).
    assert cfg.temperature == 1.0 and bool((ro["processed"] >= ro["raw"]).all())
    assert 1.0 < float(ro["kept"].sum(-1).double().mean()) < cfg.vocab / 4, "a peaked, not one-hot, head"


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_matched_head_agrees_best(ra, rollout, backend):
    cfg, ro = rollout
    cfg = dataclasses.replace(cfg, backend=backend)
    res = ra.measure(cfg, ro, log=lambda *a: None)
    a, b, c, d, e = res["cases"]
    assert 1.0 < res["entropy_fp32"] < 4.0, "next-token entropy of a few nats"
    for r in (a, b, c):
        for key in ("delta_std", "abs_diff_max", "k3"):
            assert d[key] < r[key], (key, d["label"], d[key], r["label"], r[key])
        assert d["ratio_frac_outside"] <= r["ratio_frac_outside"] and d["exact"] > r["exact"]
    # k1 is a signed mean: (c)'s bf16-rounding noise cancels in it, (d)'s tie residual does not
    # (always Δ <= 0), so k1 ranks (d) only against the heads that miss the top-p.
    assert abs(d["k1"]) < min(abs(a["k1"]), abs(b["k1"]))
    # Without the top-p the trainer's normaliser keeps the mass the engine dropped: Δ is
    # log(kept mass) on average, the same with fp32 or bf16 logits.
    for r in (a, b):
        assert r["outside_support"] == 0
        assert r["delta_mean"] == pytest.approx(res["log_kept_mass_mean"], abs=0.02)
    assert res["log_kept_mass_mean"] < -0.02
    # Matched: no sampled token is outside the trainer's kept set, and Δ = 0 on every row
    # whose top-p boundary does not fall inside a bf16 tie.
    # The reference's softmax is the engine's (torch's) to the bit; a kernel sums the row in
    # another order, so its log-probs differ from the engine's by fp32 rounding only.
    rounding = 0.0 if backend == "reference" else 1e-5
    assert d["outside_support"] == 0 and d["max_abs_delta_unsplit_rows"] <= rounding
    assert d["tokens"] == cfg.batch * cfg.response_len
    # The engine's kept set itself: the same numbers as the engine (to that rounding).
    assert e["outside_support"] == 0 and e["abs_diff_max"] <= rounding and e["tokens"] == d["tokens"]
    if backend == "reference":
        assert d["nonzero_unsplit_rows"] == 0 and e["exact"] == e["tokens"]
    # vLLM's raw_logprobs are the unfiltered bf16 softmax at T = 1: (b)'s, to fp32 rounding.
    assert res["raw_mode"]["abs_diff_max"] < 1e-4

    rows = ra.table(res).splitlines()
    assert len(rows) == 2 + len(ra.CASES) and rows[2].startswith("| (a) fp32 |")


def test_plot_writes_a_png(ra, rollout, tmp_path):
    cfg, ro = rollout
    res = ra.measure(dataclasses.replace(cfg, backend="reference"), ro, log=lambda *a: None)
    png = tmp_path / "ra.png"
    ra.plot(res, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--top-p", "1.5"], ["--top-p", "0"], ["--batch", "0"], ["--backend", "gpu"]])
def test_bad_arguments_are_rejected(ra, argv):
    with pytest.raises(SystemExit) as e:
        ra.main(argv)
    assert e.value.code == 2
