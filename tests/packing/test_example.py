"""examples/pack_grpo_batch.py runs and reports the compression it measured."""

import os
import re
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "pack_grpo_batch.py")


def test_pack_grpo_batch_example_runs():
    args = ["--groups", "3", "--group-size", "4", "--prompt", "40", "--completion", "8", "--skip-model"]
    res = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    before, after = map(int, re.search(r"before packing: (\d+), after: (\d+)", res.stdout).groups())
    # 3 groups of 4 samples of a 40-token prompt; TRL's trie forks one token early, so a group
    # forwards its first 39 prompt tokens once instead of 4 times
    assert before - after == 3 * 3 * 39, res.stdout
