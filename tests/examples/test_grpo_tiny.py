"""``examples/grpo_tiny.py`` run by the tests: the fused ops against the pure-PyTorch reference
on the example's first steps, a short run that learns, and the asynchronous loop (lag 0 is
the synchronous loop; with lag K every trained batch was generated within K versions)."""

import dataclasses

import pytest
import torch


def _run(ex, cache, steps, **kwargs):
    fields = {f.name for f in dataclasses.fields(ex.Config)}
    config = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
    cfg = dataclasses.replace(ex.Config(), steps=steps, val_every=10, **config)
    torch.set_num_threads(2)
    return ex.run(cfg, log=lambda *a: None, progress=False, cache_dir=cache, keep_model=True, **kwargs)


def _losses(res):
    return [h["loss"] for h in res["history"][1:]]


def _params_close(a, b, rtol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        err = float((p - q).abs().max() / q.abs().max())
        assert err <= rtol, f"{name}: relative difference {err:.3g}"


def test_reference_ops_give_the_same_steps(ex, cache):
    fused = _run(ex, cache, 3)
    ref = _run(ex, cache, 3, reference=True)
    assert all(h["kept_groups"] > 0 for h in fused["history"][1:]), "a step without an update proves nothing"
    for a, b in zip(_losses(fused), _losses(ref)):
        assert abs(a - b) <= 1e-5, (_losses(fused), _losses(ref))
    _params_close(fused["model"], ref["model"], 1e-5)


def test_short_run_learns(ex, cache):
    res = _run(ex, cache, 250)
    vals = [h["val_success"] for h in res["history"] if "val_success" in h]
    start = vals[0]
    assert start < 0.2, f"the warm-up left the policy at {start:.3f}, not under 0.2"
    best_late = max(vals[-3:])  # the last three validations (steps 230, 240, 250)
    assert best_late >= 0.35 and best_late >= start + 0.15, vals


def test_async_lag_zero_is_the_synchronous_loop(ex, cache):
    sync = _run(ex, cache, 4)
    lag0 = _run(ex, cache, 4, async_lag=0)
    assert _losses(sync) == _losses(lag0)
    _params_close(sync["model"], lag0["model"], 0.0)


@pytest.mark.parametrize("stale", ["drop", "correct"])
def test_async_lag_bounds_the_versions(ex, cache, stale):
    lag = 2
    res = _run(ex, cache, 8, async_lag=lag, stale=stale, max_lag=1)
    rows = res["history"][1:]
    for h in rows:
        assert h["update_version"] - lag <= h["version_min"] <= h["version_max"] <= h["update_version"], h
    # max_lag 1 < lag 2: batches two versions old are dropped, or kept and corrected.
    two_old = [h for h in rows if h["update_version"] - h["version_min"] == 2]
    key = "staleness/num_dropped" if stale == "drop" else "staleness/num_stale"
    assert all(h[key] > 0 for h in two_old)


def test_sequence_kl_sums_each_sequence(ex):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    logp, ref = torch.randn(sum(lengths), generator=gen), torch.randn(sum(lengths), generator=gen)
    want = torch.stack([(logp[a:b] - ref[a:b]).sum() for a, b in zip(cu[:-1], cu[1:])])
    torch.testing.assert_close(ex.sequence_kl(logp, ref, cu), want)


def test_sequence_kl_run_matches_the_reference_ops(ex, cache):
    fused = _run(ex, cache, 3, kl="seq", kl_coef=0.5)
    ref = _run(ex, cache, 3, kl="seq", kl_coef=0.5, reference=True)
    for a, b in zip(_losses(fused), _losses(ref)):
        assert abs(a - b) <= 1e-5, (_losses(fused), _losses(ref))
    _params_close(fused["model"], ref["model"], 1e-5)


def test_unknown_kl_is_rejected(ex, cache):
    with pytest.raises(ValueError, match="Config.kl"):
        _run(ex, cache, 1, kl="k4")
