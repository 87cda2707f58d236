"""Installing as users do: a pure-Python wheel, built without torch, whose C++ kernels are
compiled on first use into a cache keyed on torch, Python, flags and sources."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from rlvr_kernels._core import extension

REPO = Path(__file__).resolve().parents[2]


def _site_dirs():
    """The directories this interpreter imports installed packages (torch, numpy, ...) from,
    but not the repository: an editable install is a .pth file there, which a path line in
    another environment's .pth does not process."""
    import site
    import sysconfig

    dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d) and not Path(d).resolve() == REPO]


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", extension.ENV_EXTENSION)}
    env.update(PYTHONNOUSERSITE="1", **extra)
    return env


def test_wheel_is_pure_python_and_runs_from_a_fresh_environment(tmp_path):
    # The release build this test reuses (compiled here only if the cache is cold).
    lib = extension.build()
    built_at = lib.stat().st_mtime_ns

    # Build from a copy of what the package is made of, so the tree's build/ and
    # *.egg-info leftovers cannot leak into the wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(
        REPO / "rlvr_kernels", src / "rlvr_kernels", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    )
    wheels = tmp_path / "wheels"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-v", "-w", str(wheels)],
        cwd=src,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=600,
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    # Build isolation installed setuptools and wheel, nothing else: no torch.
    installs = [
        line for line in log.splitlines() if re.search(r"Collecting |Successfully installed|Downloading ", line)
    ]
    assert any("setuptools" in line for line in installs), log[-4000:]
    assert not any("torch" in line.lower() for line in installs), installs
    built = list(wheels.glob("*.whl"))
    assert len(built) == 1 and built[0].name.endswith("-py3-none-any.whl"), built
    with zipfile.ZipFile(built[0]) as zf:
        names = set(zf.namelist())
        assert not any(n.endswith((".so", ".pyd", ".dylib")) for n in names), sorted(names)
        for p in sorted((REPO / "rlvr_kernels" / "csrc").iterdir()):
            assert zf.read(f"rlvr_kernels/csrc/{p.name}") == p.read_bytes(), p.name
        assert "Requires-Dist: ninja" in zf.read("rlvr_kernels-0.1.0.dist-info/METADATA").decode().splitlines()

    # A fresh environment: the wheel first (pip run for it, so nothing else is visible
    # while installing), then a path line to where torch and the other dependencies are.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(built[0])],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (venv / "bin" / "rlvr-kernels").is_file()
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text("".join(d + "\n" for d in _site_dirs()))

    script = textwrap.dedent(
        """
        import json, torch
        import rlvr_kernels as rk
        from rlvr_kernels._core import extension

        scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 0.0, 1.0, 3.0])
        got = rk.group_advantages(scores, group_size=4, backend="cpu").advantages
        want = rk.group_advantages(scores, group_size=4, backend="reference").advantages
        print(json.dumps({
            "package": rk.__file__, "torch": torch.__file__, "loaded": extension.loaded(),
            "max_err": (got - want).abs().max().item(), "nonzero": bool(got.abs().sum() > 0),
        }))
        """
    )
    env = _clean_env(**{extension.ENV_CACHE: str(extension.cache_root())})
    res = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(out["package"]).is_relative_to(venv), out  # not the repository's editable install
    assert Path(out["torch"]).resolve() == Path(torch.__file__).resolve(), out
    assert out["loaded"] == [str(lib.resolve())], out  # the same cache key: nothing compiled
    assert "compiling" not in res.stderr and lib.stat().st_mtime_ns == built_at, res.stderr[-2000:]
    assert out["nonzero"] and out["max_err"] < 1e-6, out


def test_cache_key_follows_torch_sources_flags_and_variant(monkeypatch):
    key = extension.cache_key()
    assert key == extension.cache_key(digest=extension.sources_digest(), torch_version=torch.__version__)
    assert extension.cache_key(digest="0" * 64) != key
    assert extension.cache_key(torch_version="9.9.9") != key
    assert "torch9.9.9" in extension.cache_key(torch_version="9.9.9")
    assert extension.cache_key("sanitize") != key and extension.cache_key("sanitize").startswith("sanitize-")
    monkeypatch.setenv(extension.ENV_NATIVE, "1")
    assert "-march=native" in extension.flags()[0] and extension.cache_key() != key


def test_sources_digest_changes_with_any_source(tmp_path, monkeypatch):
    copy = tmp_path / "csrc"
    shutil.copytree(extension.source_dir(), copy)
    monkeypatch.setattr(extension, "source_dir", lambda: copy)
    before = extension.sources_digest()
    (copy / "spans.h").write_text((copy / "spans.h").read_text() + "\n")
    assert extension.sources_digest() != before


def test_cache_root_is_overridable(tmp_path, monkeypatch):
    monkeypatch.setenv(extension.ENV_CACHE, str(tmp_path / "c"))
    assert extension.library_path() == tmp_path / "c" / extension.cache_key() / extension.LIB_FILE
    monkeypatch.delenv(extension.ENV_CACHE)
    assert extension.cache_root() == Path.home() / ".cache" / "rlvr_kernels"


def test_missing_prebuilt_extension_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(extension.ENV_EXTENSION, str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="RLVR_KERNELS_EXTENSION=.*missing.so.*no such file"):
        extension.load()


def test_no_compiler_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv(extension.ENV_CACHE, str(tmp_path))  # an empty cache: it has to compile
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(extension.ExtensionUnavailable, match="C\\+\\+ compiler.*Triton \\(GPU\\) kernels"):
        extension.build()
    assert not any(tmp_path.iterdir())


def test_release_flags_are_portable_and_sanitize_flags_keep_overflow_checks():
    cflags, _ = extension.flags()
    assert "-O3" in cflags and "-fopenmp" in cflags and "-march=native" not in cflags
    san, san_ld = extension.flags("sanitize")
    assert "-fno-wrapv" in san and "-fwrapv" not in san and "-fsanitize=address,undefined" in san_ld
    # torch's load() adds no Python CFLAGS (-fwrapv) of its own: the generated build file.
    ninja = (extension.build().parent / "build" / "build.ninja").read_text()
    line = next(x for x in ninja.splitlines() if x.startswith("cflags = "))
    assert "-fwrapv" not in line and " -O3 " in line and "-march=native" not in line, line


def test_concurrent_first_uses_compile_once(tmp_path):
    """Two processes find an empty cache at once: one compiles (a stand-in compile here),
    the other waits on the lock and returns the same library."""
    script = textwrap.dedent(
        f"""
        import os, time
        from rlvr_kernels._core import extension

        def fake_compile(variant, out, verbose):
            with open({str(tmp_path / "compiles")!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(1.5)
            (out / extension.LIB_FILE).write_bytes(b"")

        extension._compile = fake_compile
        print(extension.build())
        """
    )
    env = _clean_env(**{extension.ENV_CACHE: str(tmp_path / "cache")})
    procs = [
        subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len((tmp_path / "compiles").read_text().splitlines()) == 1
    assert outs[0] == outs[1] and outs[0].startswith(str(tmp_path / "cache"))
