"""Ahead-of-time compiles of every Triton kernel for sm_80 and sm_90, no GPU needed.

``python -m rlvr_kernels.triton.aot`` prints one JSON line per (kernel, variant, arch)
with the registers and spill bytes ``ptxas -v`` reports for the generated PTX (the
compiled kernel's own metadata only fills these in on a real device) and the matrix
instructions (HGMMA / HMMA / DMMA) in the SASS of Triton's cubin (``cuobjdump``). Run it
without ``TRITON_INTERPRET``: interpreted kernels cannot be compiled.

A spec is (name, kernel, signature, constexprs[, options]). A signature type may carry a
``:16`` divisibility hint (``"*bf16:16"``, ``"i32:16"``), as Triton's own launcher adds for
16-byte-aligned pointers and multiples of 16 at run time; GEMM kernels need it on the
pointers and the row length to get vectorised (and spill-free) tile loads. ``options``:
``num_warps`` / ``num_stages`` of the launch, and ``archs``: compile this spec for these
archs only (a kernel whose launch configuration depends on the arch has one spec per arch).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List, Tuple

from . import AOT_ARCHS as ARCHS


def kernel_specs() -> Iterator[Tuple]:
    """(name, kernel, signature, constexprs[, options]) for each kernel variant worth compiling:
    each kernel module's ``aot_specs()``, which lives next to the kernels it describes."""
    from . import advantages, logprobs, policy_loss, rollout_mismatch

    for module in (advantages, policy_loss, logprobs, rollout_mismatch):
        yield from module.aot_specs()


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself uses for this arch (Triton 3.9 ships two; older ones one)."""
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(arch).path
    except TypeError:  # Triton < 3.9: get_ptxas() takes no arch
        return compiler.get_ptxas().path


def ptxas_usage(ptx: str, arch: int) -> Dict[str, int]:
    """Registers and spill bytes from ``ptxas -v`` on the PTX Triton generated."""
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [_ptxas(arch), "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}", src, "-o", out]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed: {res.stderr[-2000:]}")
    text = res.stderr + res.stdout
    regs = re.findall(r"Used (\d+) registers", text)
    stores = re.findall(r"(\d+) bytes spill stores", text)
    loads = re.findall(r"(\d+) bytes spill loads", text)
    return {
        "registers": max(map(int, regs)) if regs else -1,
        "spill_store_bytes": sum(map(int, stores)),
        "spill_load_bytes": sum(map(int, loads)),
    }


def sass_mma(cubin: bytes) -> List[str]:
    """The matrix-multiply opcodes (HGMMA, HMMA, DMMA, ...) in a cubin's SASS, sorted."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {res.stderr[-2000:]}")
    return sorted(set(re.findall(r"\b(HGMMA|HMMA|DMMA|IMMA|IGMMA|QGMMA|BMMA)\b", res.stdout)))


def compile_all(archs=ARCHS, only: str = "", shard: Tuple[int, int] = (0, 1)) -> List[Dict]:
    """Compile every spec (whose name contains ``only``) for each arch; ``shard=(k, n)``
    takes every n-th spec from the k-th (for parallel compiles in separate processes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for i, (name, kernel, sig, const, *rest) in enumerate(kernel_specs()):
        if only not in name or i % shard[1] != shard[0]:
            continue
        options = dict(rest[0]) if rest else {}
        spec_archs = options.pop("archs", archs)
        full_sig = {n: t.split(":")[0] for n, t in sig.items()}
        full_sig.update({c: "constexpr" for c in const})
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.endswith(":16")}
        for arch in (a for a in archs if a in spec_archs):
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=full_sig, constexprs=const, attrs=attrs),
                target=GPUTarget("cuda", arch, 32),
                options=options,
            )
            usage = ptxas_usage(compiled.asm["ptx"], arch)
            rows.append({"kernel": name, "arch": f"sm_{arch}", **usage, "mma": sass_mma(compiled.asm["cubin"])})
    return rows


def _main(argv: List[str]) -> None:
    """``[filter] [--shard k/n]``. Without ``--shard``, the specs are split over one
    process per CPU core (compiling is single-threaded and takes seconds per variant)."""
    shard = None
    if "--shard" in argv:
        i = argv.index("--shard")
        k, n = argv[i + 1].split("/")
        shard = (int(k), int(n))
        argv = argv[:i] + argv[i + 2 :]
    only = argv[0] if argv else ""
    if shard is not None:
        for row in compile_all(only=only, shard=shard):
            print(json.dumps(row), flush=True)
        return
    jobs = max(1, min(len(os.sched_getaffinity(0)), 8))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "rlvr_kernels.triton.aot", only, "--shard", f"{k}/{jobs}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(jobs)
    ]
    failed = 0
    for p in procs:
        out, _ = p.communicate()
        sys.stdout.write(out)
        failed |= p.returncode != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled ahead of time")
    _main(sys.argv[1:])
