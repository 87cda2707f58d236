"""rlvr_kernels.async_rollout: staleness bookkeeping on hand-built version stamps, and the
bounded-lag producer against a deterministic toy trainer. Every wait is bounded (WAIT), so
a broken producer fails a test instead of hanging the suite."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

import rlvr_kernels as rk
from rlvr_kernels.async_rollout import (
    ProducerClosed,
    Rollout,
    RolloutError,
    RolloutProducer,
    StalenessOptions,
    staleness,
    staleness_mask,
)

WAIT = 5.0  # seconds: the bound on every blocking call in this file


# ------------------------------------------------------------------ staleness bookkeeping
# Six samples at training version 6; samples 1, 3 and 5 spanned a weight update.
VMIN = [0, 1, 2, 3, 5, 5]
VMAX = [0, 2, 2, 4, 5, 6]
CURRENT = 6
LAG = [6, 5, 4, 3, 1, 1]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_staleness_is_current_minus_the_oldest_version(dtype):
    s = staleness(torch.tensor(VMIN, dtype=dtype), torch.tensor(VMAX, dtype=dtype), CURRENT)
    assert s.dtype == torch.int64
    assert s.tolist() == LAG


def test_drop_masks_the_stale_samples_and_counts_them():
    res = staleness_mask(torch.tensor(VMIN), torch.tensor(VMAX), CURRENT, StalenessOptions(max_lag=3))
    assert res.staleness.tolist() == LAG
    assert res.keep.tolist() == [False, False, False, True, True, True]
    assert res.correct.tolist() == [False] * 6
    st = res.stats
    assert st.histogram.dtype == torch.int64
    assert st.histogram.tolist() == [0, 2, 0, 1, 3]  # bins 0..3, then the overflow bin (lags 4, 5, 6)
    assert st.mean.item() == pytest.approx(sum(LAG) / 6)
    assert st.max.item() == 6
    assert st.num_stale.item() == 3 and st.num_dropped.item() == 3
    assert st.num_spanning.item() == 3


def test_correct_keeps_every_sample_and_flags_the_stale_ones():
    res = staleness_mask(torch.tensor(VMIN), torch.tensor(VMAX), CURRENT, StalenessOptions(3, stale="correct"))
    assert res.keep.tolist() == [True] * 6
    assert res.correct.tolist() == [True, True, True, False, False, False]
    assert res.stats.num_dropped.item() == 0 and res.stats.num_stale.item() == 3
    assert res.stats.histogram.tolist() == [0, 2, 0, 1, 3]


def test_histogram_with_every_sample_in_the_overflow_bin_and_lag_zero():
    res = staleness_mask(torch.tensor([0, 0]), torch.tensor([0, 1]), 2, StalenessOptions(0))
    assert res.stats.histogram.tolist() == [0, 2]
    assert res.keep.tolist() == [False, False]
    fresh = staleness_mask(torch.tensor([2, 2]), torch.tensor([2, 2]), 2, StalenessOptions(0))
    assert fresh.stats.histogram.tolist() == [2, 0] and fresh.keep.all()


def test_stats_to_dict_gives_floats_for_logging():
    res = staleness_mask(torch.tensor(VMIN), torch.tensor(VMAX), CURRENT, StalenessOptions(3))
    d = res.stats.to_dict()
    assert all(isinstance(v, float) for v in d.values())
    assert d["staleness/max"] == 6.0 and d["staleness/num_dropped"] == 3.0
    assert [d[f"staleness/hist_{k}"] for k in range(4)] + [d["staleness/hist_overflow"]] == [0.0, 2.0, 0.0, 1.0, 3.0]
    assert set(res.stats.to_dict(prefix="").keys()) >= {"mean", "max", "num_stale", "num_spanning"}


def test_empty_batch_gives_zeros_never_nan():
    empty = torch.zeros(0, dtype=torch.int64)
    res = staleness_mask(empty, empty, 4, StalenessOptions(2))
    assert res.staleness.shape == (0,) and res.keep.shape == (0,)
    d = res.stats.to_dict()
    assert all(v == 0.0 for v in d.values()), d
    assert res.stats.histogram.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    "vmin, vmax, current, exc, name",
    [
        (torch.tensor([0.0]), torch.tensor([0]), 1, TypeError, "version_min"),
        (torch.tensor([0]), torch.tensor([0.0]), 1, TypeError, "version_max"),
        (torch.tensor([[0]]), torch.tensor([[0]]), 1, ValueError, "version_min"),
        (torch.tensor([0, 1]), torch.tensor([0]), 1, ValueError, "version_max"),
        ([0], torch.tensor([0]), 1, TypeError, "version_min"),
        (torch.tensor([-1]), torch.tensor([0]), 1, ValueError, "version_min"),
        (torch.tensor([2]), torch.tensor([1]), 3, ValueError, "version_max"),
        (torch.tensor([0]), torch.tensor([4]), 3, ValueError, "version_max"),
        (torch.tensor([0]), torch.tensor([0]), -1, ValueError, "current_version"),
        (torch.tensor([0]), torch.tensor([0]), 1.0, TypeError, "current_version"),
    ],
)
def test_invalid_stamps_raise_naming_the_argument(vmin, vmax, current, exc, name):
    with pytest.raises(exc, match=name):
        staleness(vmin, vmax, current)
    with pytest.raises(exc, match=name):
        staleness_mask(vmin, vmax, current, StalenessOptions(1))


def test_validate_false_skips_the_value_checks():
    assert staleness(torch.tensor([2]), torch.tensor([1]), 1, validate=False).tolist() == [-1]


def test_invalid_options_raise_naming_the_field():
    with pytest.raises(ValueError, match="max_lag"):
        StalenessOptions(-1)
    with pytest.raises(TypeError, match="max_lag"):
        StalenessOptions(1.5)
    with pytest.raises(ValueError, match="max_lag"):
        StalenessOptions(10**9)
    with pytest.raises(ValueError, match="stale"):
        StalenessOptions(1, stale="ignore")
    with pytest.raises(TypeError, match="options"):
        staleness_mask(torch.tensor([0]), torch.tensor([0]), 0, {"max_lag": 1})


def test_rollout_stamps_broadcast_batch_level_versions():
    vmin, vmax = Rollout(3, 1, 2, None).stamps(4)
    assert vmin.tolist() == [1] * 4 and vmax.tolist() == [2] * 4 and vmin.dtype == torch.int64
    vmin, vmax = Rollout(3, torch.tensor([1, 2], dtype=torch.int32), 2, None).stamps()
    assert vmin.tolist() == [1, 2] and vmax.tolist() == [2, 2] and vmin.dtype == torch.int64
    with pytest.raises(ValueError, match="batch_size"):
        Rollout(3, 1, 2, None).stamps()
    with pytest.raises(ValueError, match="batch_size"):
        Rollout(3, torch.tensor([1, 2]), 2, None).stamps(3)


def test_correct_rows_only_are_reweighted_by_policy_loss():
    """The module docstring's recipe: rows not flagged get rollout_logprobs = old_logprobs,
    an importance weight of exactly 1, so flagging nothing equals no correction."""
    g = torch.Generator().manual_seed(0)
    B, L = 5, 7
    logp = torch.randn(B, L, generator=g, dtype=torch.float64) * 0.1 - 1.0
    old = logp + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.05
    behaviour = old + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, L, generator=g) < 0.8
    plain, _ = rk.policy_loss(logp, old, adv, mask)
    none = staleness_mask(torch.tensor([4] * B), torch.tensor([4] * B), 5, StalenessOptions(1, stale="correct"))
    rollout_lp = torch.where(none.correct[:, None], behaviour, old)
    same, m = rk.policy_loss(logp, old, adv, mask, rollout_correction="token_tis", rollout_logprobs=rollout_lp)
    assert torch.equal(same, plain) and m.is_weight_mean.item() == 1.0
    some = staleness_mask(torch.tensor([1, 4, 1, 4, 4]), torch.tensor([4] * B), 5, StalenessOptions(1, "correct"))
    rollout_lp = torch.where(some.correct[:, None], behaviour, old)
    per_tok, _ = rk.policy_loss(
        logp, old, adv, mask, rollout_correction="token_tis", rollout_logprobs=rollout_lp, agg="none"
    )
    plain_tok, _ = rk.policy_loss(logp, old, adv, mask, agg="none")
    changed = (per_tok != plain_tok).any(-1)
    assert not changed[~some.correct].any() and changed[some.correct].all()


# ------------------------------------------------------------------ toy trainer
# A scalar "weight" updated from each batch; generate's batch is a function of the weights
# it got, so any difference in the version a batch was generated with shows in the numbers.
def toy_batch(i: int, w: float) -> torch.Tensor:
    return torch.tensor([w * 0.5 + i, w - 0.25 * i, 0.01 * w * w + 1.0], dtype=torch.float64)


def toy_update(w: float, batch: torch.Tensor) -> float:
    return 0.9 * w - 0.1 * float(batch.mean()) + 0.3


def synchronous_run(n: int):
    w, out = 1.0, []
    for i in range(n):
        batch = toy_batch(i, w)
        w = toy_update(w, batch)
        out.append((batch, w))
    return out


def test_lag_zero_equals_the_synchronous_loop_step_for_step():
    n = 12
    expected = synchronous_run(n)

    def generate(i, payload, version, latest):
        assert version == i  # lag 0: batch i waits for version i
        return toy_batch(i, payload)

    w = 1.0
    with RolloutProducer(generate, 0, initial_payload=w, timeout=WAIT, num_batches=n) as producer:
        for i in range(n):
            r = producer.get()
            assert r.batch_index == i and r.version_min == r.version_max == i
            w = toy_update(w, r.data)
            assert torch.equal(r.data, expected[i][0]) and w == expected[i][1]
            producer.publish(i + 1, w)
        with pytest.raises(ProducerClosed, match="delivered"):
            producer.get()
    assert not producer.is_alive()


def _lagged_run(lag: int, n: int, slow: str):
    """The toy run with the producer up to ``lag`` versions ahead; every sample is stamped
    per sample (generate picks up new weights after its first sample). ``slow="trainer"``:
    the trainer waits before each update until the producer has started the farthest batch
    the gate allows (deterministically the slowest trainer); ``slow="generate"``: generation
    sleeps. Returns the trained rollouts with their update versions."""
    started = [threading.Event() for _ in range(n)]

    def generate(i, payload, version, latest):
        started[i].set()
        if slow == "generate":
            time.sleep(0.002)
        first = toy_batch(i, payload)[:1]
        v2, payload2 = latest()
        rest = toy_batch(i, payload2)[1:]
        vmin = torch.tensor([version, version, v2])  # sample 1 started at `version`, finished at v2
        vmax = torch.tensor([version, v2, v2])
        return Rollout(i, vmin, vmax, torch.cat([first, rest]))

    trained = []
    w = 1.0
    with RolloutProducer(generate, lag, initial_payload=w, timeout=WAIT, num_batches=n) as producer:
        for i in range(n):
            r = producer.get()
            trained.append((i, r))
            if slow == "trainer":
                assert started[min(i + lag, n - 1)].wait(WAIT)
            w = toy_update(w, r.data)
            producer.publish(i + 1, w)
    assert not producer.is_alive()
    return trained


@pytest.mark.parametrize("lag", [1, 2, 3])
@pytest.mark.parametrize("slow", ["trainer", "generate"])
def test_every_trained_sample_is_within_lag_and_never_newer(lag, slow):
    for step, r in _lagged_run(lag, 10, slow):
        assert r.batch_index == step
        vmin, vmax = r.stamps()
        assert (vmin >= step - lag).all() and (vmax <= step).all(), (step, vmin, vmax)
        res = staleness_mask(vmin, vmax, step, StalenessOptions(lag))  # the guard never fires
        assert res.keep.all() and res.stats.max.item() <= lag
        if slow == "trainer":  # the producer ran ahead: batch `step` started at version step - lag
            assert vmin[0].item() == max(step - lag, 0)


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_producer_runs_exactly_lag_versions_ahead(lag):
    """While the trainer holds version 0, batches 1..lag are generated (with version 0 <
    their step), and batch lag + 1 waits for version 1."""
    started, reached = [], threading.Event()

    def generate(i, payload, version, latest):
        started.append((i, version))
        if i == lag:
            reached.set()
        return toy_batch(i, payload)

    with RolloutProducer(generate, lag, initial_payload=1.0, timeout=WAIT, num_batches=lag + 3) as producer:
        assert producer.get().batch_index == 0
        assert reached.wait(WAIT), started
        time.sleep(0.05)  # room for a (wrong) start of batch lag + 1
        assert started == [(i, 0) for i in range(lag + 1)]
        producer.publish(1, 2.0)
        for i in range(1, lag + 3):
            r = producer.get()
            assert r.batch_index == i and i - lag <= r.version_min <= i
            producer.publish(i + 1, 2.0 + i)
    assert dict(started)[lag + 1] >= 1  # started only once version 1 was out


def test_batch_spanning_an_update_gets_min_below_max():
    """generate for batch 1 (lag 1, started at version 0) waits for the trainer's version 1
    and picks it up through latest(): the batch-level stamps become (0, 1)."""
    published = threading.Event()

    def generate(i, payload, version, latest):
        if i == 1:
            assert published.wait(WAIT)
            v, _ = latest()
            assert v == 1
        return i

    with RolloutProducer(generate, 1, initial_payload=0.0, timeout=WAIT, num_batches=2) as producer:
        r0 = producer.get()
        assert (r0.version_min, r0.version_max) == (0, 0)
        producer.publish(1, 1.0)
        published.set()
        r1 = producer.get()
    assert (r1.batch_index, r1.version_min, r1.version_max) == (1, 0, 1)
    vmin, vmax = r1.stamps(3)
    res = staleness_mask(vmin, vmax, 1, StalenessOptions(1))
    assert res.stats.num_spanning.item() == 3 and res.staleness.tolist() == [1, 1, 1]


# ------------------------------------------------------------------ shutdown and errors
class TrainerFailed(Exception):
    pass


def _poll_until_closed(i, payload, version, latest):
    """A long generation that polls latest(): close() ends it (ProducerClosed)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        latest()
        time.sleep(0.001)
    return i


@pytest.mark.parametrize(
    "where, generate, lag, queue_size",
    [
        ("version gate", lambda i, p, v, latest: i, 0, None),
        ("full queue", lambda i, p, v, latest: i, 3, 1),
        ("inside generate", _poll_until_closed, 1, None),
    ],
)
def test_trainer_exception_stops_the_producer_and_propagates(where, generate, lag, queue_size):
    producer = RolloutProducer(generate, lag, initial_payload=0, queue_size=queue_size, timeout=WAIT)
    t0 = time.monotonic()
    with pytest.raises(TrainerFailed):
        with producer:
            if where != "inside generate":
                producer.get()
            time.sleep(0.02)  # let the producer reach the place it blocks
            raise TrainerFailed("the update failed")
    assert not producer.is_alive()
    assert time.monotonic() - t0 < WAIT
    with pytest.raises(ProducerClosed):
        producer.get(timeout=0)
    with pytest.raises(ProducerClosed):
        producer.publish(1, 0)


def test_generate_exception_reaches_get_after_the_good_batches():
    def generate(i, payload, version, latest):
        if i == 2:
            raise KeyError("boom")
        return i

    with RolloutProducer(generate, 3, initial_payload=0, timeout=WAIT) as producer:
        assert [producer.get().data for _ in range(2)] == [0, 1]
        for _ in range(2):  # and again: the failure stays
            with pytest.raises(RolloutError, match="batch 2") as info:
                producer.get()
            assert isinstance(info.value.__cause__, KeyError)
        deadline = time.monotonic() + WAIT
        while producer.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not producer.is_alive()  # the thread ended with its failure


def test_a_bad_returned_rollout_reaches_get():
    def generate(i, payload, version, latest):
        return Rollout(i, torch.tensor([version + 1]), torch.tensor([version + 1]), None)  # never handed out

    with RolloutProducer(generate, 0, initial_payload=0, timeout=WAIT) as producer:
        with pytest.raises(RolloutError) as info:
            producer.get()
    assert "version_min" in str(info.value.__cause__)


def test_get_times_out_when_nothing_comes():
    with RolloutProducer(lambda i, p, v, latest: i, 0, initial_payload=0, timeout=WAIT) as producer:
        assert producer.get().data == 0
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="publish"):
            producer.get(timeout=0.05)  # batch 1 waits for version 1, never published
        assert time.monotonic() - t0 < WAIT


def test_close_raises_when_generate_does_not_stop_and_the_with_block_warns():
    release = threading.Event()

    def stuck(i, payload, version, latest):
        release.wait(WAIT)  # ignores the shutdown: never polls latest()
        return i

    producer = RolloutProducer(stuck, 0, initial_payload=0, timeout=WAIT)
    with pytest.raises(RuntimeError, match="did not stop"):
        producer.close(timeout=0.05)
    release.set()
    producer.close(timeout=WAIT)
    assert not producer.is_alive()

    release.clear()
    producer = RolloutProducer(stuck, 0, initial_payload=0, timeout=WAIT)
    with pytest.warns(RuntimeWarning, match="did not stop"):
        with pytest.raises(TrainerFailed):
            with producer:
                producer.close = functools.partial(RolloutProducer.close, producer, 0.05)  # keep the test short
                raise TrainerFailed("the update failed")
    release.set()
    RolloutProducer.close(producer, timeout=WAIT)
    assert not producer.is_alive()


def test_invalid_producer_arguments_raise_naming_them():
    gen = lambda i, p, v, latest: i  # noqa: E731
    with pytest.raises(TypeError, match="generate"):
        RolloutProducer(None, 1, initial_payload=0)
    with pytest.raises(ValueError, match="max_lag"):
        RolloutProducer(gen, -1, initial_payload=0)
    with pytest.raises(ValueError, match="queue_size"):
        RolloutProducer(gen, 1, initial_payload=0, queue_size=0)
    with pytest.raises(ValueError, match="timeout"):
        RolloutProducer(gen, 1, initial_payload=0, timeout=-1.0)
    with RolloutProducer(gen, 1, initial_payload=0, timeout=WAIT) as producer:
        with pytest.raises(ValueError, match="version"):
            producer.publish(0, 0)
        producer.publish(2, 0)
        with pytest.raises(ValueError, match="version"):
            producer.publish(1, 0)
        assert producer.version == 2
