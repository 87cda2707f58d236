"""The small examples run and print/write what they claim: examples/advantage_normalisation.py
(numbers parsed back and compared with the formulas) and examples/dynamics_plot.py (a PNG)."""

from __future__ import annotations

import math
import re
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NUM = r"(-?\d+\.\d+)"


def _main(name: str):
    # run_path with another run_name imports the script without running its __main__ block.
    return runpy.run_path(str(EXAMPLES / name), run_name="example")["main"]


def _advantage_rows(out: str):
    block = out.split("\nadvantages\n", 1)[1].split("\n")[1:]
    rows = []
    for line in block:
        m = re.fullmatch(rf"\s*(\d+)\s+{NUM}\s+{NUM}\s+{NUM}", line)
        if not m:
            break
        rows.append((int(m[1]), float(m[2]), float(m[3]), float(m[4])))
    return rows


def _shaped_table(out: str, kind: str):
    head = re.search(rf"shaped token advantages, sample (\d+) \({kind}, A = {NUM}\)\n.*\n", out)
    rows = []
    for line in out[head.end() :].split("\n"):
        m = re.fullmatch(rf"\s*(\d+)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}", line)
        if not m:
            break
        rows.append(tuple(float(x) for x in m.groups()[1:]))
    return int(head[1]), float(head[2]), rows


def test_advantage_normalisation_prints_the_formulas(capsys):
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0]
    _main("advantage_normalisation.py")(["--rewards", ",".join(map(str, rewards)), "--lengths", "4,6,8,3,5"])
    out = capsys.readouterr().out

    rows = _advantage_rows(out)
    assert [r[0] for r in rows] == list(range(len(rewards)))
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    for i, r, a_mean, a_std in rows:
        assert r == rewards[i]
        assert a_mean == pytest.approx(r - mean, abs=1e-4)
        assert a_std == pytest.approx((r - mean) / (std + 1e-6), abs=1e-4)

    i, a, table = _shaped_table(out, "correct")
    assert rewards[i] == 1.0 and a > 0 and len(table) == 8  # the longest correct response
    second_lowest = sorted(p for p, *_ in table)[1]  # A3PO scales the k = ⌊8/4⌋ = 2 lowest by 2
    for p, tok, shaped, a3po in table:
        assert tok == pytest.approx(a, abs=1e-4)
        assert shaped == pytest.approx(a * (1 - p), abs=2e-4)  # low-probability tokens keep most of A
        assert a3po == pytest.approx(2 * a if p <= second_lowest else a, abs=2e-4)
    i, a, table = _shaped_table(out, "wrong")
    assert rewards[i] == 0.0 and a < 0 and len(table) == 6
    for p, tok, shaped, _ in table:
        assert tok == pytest.approx(a, abs=1e-4)
        assert shaped == pytest.approx(a * p, abs=2e-4)  # confident wrong tokens keep the penalty


def test_advantage_normalisation_degenerate_group(capsys):
    _main("advantage_normalisation.py")(["--rewards", "1,1,1,1"])
    out = capsys.readouterr().out
    assert all(a_mean == 0 and a_std == 0 for *_, a_mean, a_std in _advantage_rows(out))
    assert "degenerate" in out and "nothing to shape" in out


def test_advantage_normalisation_rejects_bad_lengths():
    with pytest.raises(SystemExit):
        _main("advantage_normalisation.py")(["--rewards", "1,0", "--lengths", "3"])


def test_dynamics_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "sub" / "dyn.png"
    _main("dynamics_plot.py")(["--out", str(out), "--steps", "8"])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    text = capsys.readouterr().out
    row = re.search(r"^\s*0\.2\s+1\s+(\d\.\d{4})\s+(\d\.\d{4})$", text, re.M)
    assert row and row[1] == "0.6813"  # docs/dynamics.md's p_ref = 0.2, β = 1 fixed point
