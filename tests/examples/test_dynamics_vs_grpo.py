"""``examples/dynamics_vs_grpo.py`` on a few steps: the predictions are the recursion's fixed
points of the measured reference success rates, and the measurements are well-formed."""

import dataclasses

import pytest
import torch

from rlvr_kernels import dynamics as dyn


def test_predictions_and_measurements(dvg, ex, cache, tmp_path):
    torch.set_num_threads(2)
    cfg = dataclasses.replace(ex.Config(), val_every=100)
    betas, steps, samples = [0.5, 2.0], 3, 4
    res = dvg.experiment(cfg, betas, steps=steps, samples=samples, tail=2, log=lambda *a: None, cache_dir=cache)

    p_ref = torch.tensor(res["p_ref"], dtype=torch.float64)
    assert p_ref.numel() == cfg.val_size
    assert torch.all((p_ref * samples).round() == p_ref * samples), "a rate of `samples` draws"
    assert res["p_ref_mean"] == pytest.approx(float(p_ref.mean()))
    assert res["solved_fraction"] == pytest.approx(float((p_ref > 0).double().mean()))
    assert res["p_ref_mean"] > 0, "the warm-up must leave some success to amplify"

    assert [r["beta"] for r in res["runs"]] == betas
    for r in res["runs"]:
        pred = r["predicted"]
        assert pred["pooled"] == pytest.approx(float(dyn.grpo_fixed_point(p_ref.mean(), r["beta"])), abs=1e-12)
        assert pred["per_prompt"] == pytest.approx(float(dyn.grpo_fixed_point(p_ref, r["beta"]).mean()), abs=1e-12)
        # A tilt of positive strength raises the success rate, and an unsolved prompt stays at 0:
        # the per-prompt mean is at most the solved share.
        assert pred["pooled"] > res["p_ref_mean"]
        assert pred["per_prompt"] <= res["solved_fraction"] + 1e-12
        m = r["measured"]
        for key in ("final", "final_solved", "final_unsolved", "reward_tail"):
            assert 0.0 <= m[key] <= 1.0, (key, m[key])
        assert len(r["reward_curve"]) == steps
        assert m["reward_tail"] == pytest.approx(sum(r["reward_curve"][-2:]) / 2)
    # A stronger KL pulls the predicted fixed point towards the reference.
    assert res["runs"][0]["predicted"]["pooled"] > res["runs"][1]["predicted"]["pooled"]

    rows = dvg.table(res).splitlines()
    assert len(rows) == 2 + len(betas) and rows[2].startswith("| 0.5 |")
    png = tmp_path / "cmp.png"
    dvg.plot(res, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--betas", "0.1,x"], ["--betas", "0,1"], ["--steps", "0"]])
def test_bad_arguments_are_rejected(dvg, argv):
    with pytest.raises(SystemExit) as e:
        dvg.main(argv)
    assert e.value.code == 2
