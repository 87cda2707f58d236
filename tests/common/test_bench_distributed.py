"""The communication benchmark (``rlvr_kernels/bench/distributed.py``) on 2 gloo processes at
a small scale: every op issues at most one collective beyond the ones its result needs, and
the bytes are what the ops' docstrings say (a policy-loss table of 7 float64 per rank, two
float64 counts, per-group partials of 5 float64 plus the handshake, a [W, 4] float64 table)."""

from rlvr_kernels.bench.distributed import GROUPS, measure, to_markdown


def test_collectives_and_bytes():
    scale = 0.05
    rows = {r["op"]: r for r in measure(worlds=(2,), scale=scale)}
    assert set(rows) == {
        "group_advantages",
        "policy_loss",
        "policy_loss(cp_group=...)",
        "global_counts",
        "linear_logprobs forward",
        "linear_logprobs backward",
    }
    for op, r in rows.items():
        assert r["needed"] <= r["collectives"] <= r["needed"] + 1, (op, r["names"])
    assert rows["policy_loss"]["names"] == ["all_reduce"]
    assert rows["policy_loss"]["local_bytes"] == 7 * 8 * 2  # [world, 7] float64
    cp = rows["policy_loss(cp_group=...)"]  # the handshake, the sequence statistics, the metrics
    assert len(cp["names"]) == 3 and cp["received_bytes"] < cp["naive_received_bytes"], cp
    assert rows["global_counts"]["local_bytes"] == 16
    groups = int(GROUPS * scale)
    assert rows["group_advantages"]["local_bytes"] == 2 * 4 * 8 + 5 * 8 * groups  # W = 2
    fwd = rows["linear_logprobs forward"]
    assert fwd["received_bytes"] * 100 < fwd["naive_received_bytes"]
    bwd = rows["linear_logprobs backward"]
    assert bwd["names"] == ["all_reduce"] and bwd["local_bytes"] == bwd["naive_local_bytes"]
    table = to_markdown(list(rows.values()), "today")
    assert table.count("\n| ") == 1 + len(rows)  # the header, one line per op
