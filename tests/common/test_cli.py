"""The `rlvr-kernels` command: info, build, check and a quick bench."""

import json
import os
import subprocess
import sys


def run_cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "rlvr_kernels", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=900
    )


def test_info():
    from rlvr_kernels._core import extension

    res = run_cli("info")
    assert res.returncode == 0, res.stderr
    assert f"{extension.build()} (built)" in res.stdout  # where the C++ kernels are
    assert "triton" in res.stdout and "torch" in res.stdout


def test_build_prints_the_cached_library():
    from rlvr_kernels._core import extension

    lib = extension.build()
    res = run_cli("build")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(lib)  # stdout is the path only, for scripts


def _check_lines(stdout, op):
    return [line for line in stdout.splitlines() if line.startswith(op)]


def test_check_passes_for_every_backend():
    # policy_loss's check cases on Triton (interpreted here: about a minute) are the option
    # sets tests/policy_loss runs on every backend; here its reference and cpu rows.
    ops = ("group_advantages", "linear_logprobs", "packing")
    res = run_cli("check", *(a for op in ops for a in ("--op", op)))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    # (packing's plan is built on the host: its kernels have no Triton row)
    expected = {"packing": {"reference", "cpu"}}
    for op in ops:
        lines = _check_lines(res.stdout, op)
        assert {line.split()[1] for line in lines} == expected.get(op, {"reference", "cpu", "triton"}), op
        assert all(line.rstrip().endswith("pass") for line in lines)
    assert not _check_lines(res.stdout, "policy_loss")  # --op selects


def test_check_policy_loss_reference_and_cpu():
    from rlvr_kernels.testing import CHECK_SUITES

    res = run_cli("check", "--op", "policy_loss", "--backend", "reference", "--backend", "cpu")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    lines = _check_lines(res.stdout, "policy_loss")
    assert len(lines) == 2 * CHECK_SUITES["policy_loss"].count()
    assert all(line.rstrip().endswith("pass") for line in lines)


def test_check_fails_loudly_on_a_wrong_kernel(tmp_path):
    # A backend that returns wrong numbers must fail `check` with exit code 1.
    code = (
        "import sys, torch\n"
        "import rlvr_kernels.ops.advantages as m\n"
        "orig = m._group_advantages_op\n"
        "def wrong(*a):\n"
        "    out = list(orig(*a)); out[0] = out[0] + 1e-3; return tuple(out)\n"
        "m._group_advantages_op = wrong\n"
        "from rlvr_kernels.cli import main\n"
        "sys.exit(main(['check', '--backend', 'cpu']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout[-2000:]
    assert "FAIL (advantages" in res.stdout


def test_quick_bench_writes_table_plot_and_results(tmp_path):
    res = run_cli("bench", "--quick", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| method | ms | ratio |" in res.stdout
    files = sorted(os.listdir(tmp_path))
    assert any(f.endswith("-quick.json") for f in files) and any(f.endswith(".png") for f in files), files
    report = json.load(open(tmp_path / [f for f in files if f.endswith(".json")][0]))
    names = {r["key"] for res_ in report["results"] for r in res_["rows"]}
    assert {"fused", "eager", "verl_loop", "verl_vec", "floor"} <= names
    for res_ in report["results"]:
        for r in res_["rows"]:
            assert r["ms"] > 0
