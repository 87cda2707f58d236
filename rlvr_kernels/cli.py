"""``rlvr-kernels info | build | check | bench`` (also ``python -m rlvr_kernels``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys


def _reexec_with_triton_interpreter(argv) -> None:
    """Without a GPU, Triton kernels only run in Triton's interpreter, which must be
    switched on before Triton is first imported (torch imports it early). So the CLI
    restarts itself once with TRITON_INTERPRET=1."""
    import torch

    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    args = sys.argv[1:] if argv is None else list(argv)
    os.execve(sys.executable, [sys.executable, "-m", "rlvr_kernels", *args], env)


def _triton_mode() -> str:
    import torch

    from ._core import dispatch as _dispatch

    if not _dispatch.triton_available():
        return "not installed"
    import triton

    if _dispatch.triton_interpreted():
        return f"{triton.__version__}, interpreted (TRITON_INTERPRET=1)"
    if torch.cuda.is_available():
        return f"{triton.__version__}, compiled for {torch.cuda.get_device_name()}"
    return f"{triton.__version__}, no GPU (set TRITON_INTERPRET=1 to interpret on CPU)"


def _extension_state() -> str:
    """Where the C++ kernels are loaded from, without compiling them (``info`` stays fast)."""
    from ._core import extension

    env = os.environ.get(extension.ENV_EXTENSION)
    if env:
        state = "present" if os.path.isfile(env) else "MISSING"
        return f"{env} ({extension.ENV_EXTENSION}, {state})"
    lib = extension.library_path()
    if lib.is_file():
        return f"{lib} (built)"
    return f"not built yet: compiled on first use or by `rlvr-kernels build`, into {lib.parent}"


def cmd_build(args) -> int:
    from ._core import extension

    variant = "sanitize" if args.sanitize else "release"
    try:
        lib = extension.build(variant, verbose=args.verbose)
    except RuntimeError as exc:
        print(f"rlvr-kernels build: {exc}", file=sys.stderr)
        return 1
    print(lib)  # stdout carries the path only (make sanitize reads it)
    return 0


def cmd_info(_args) -> int:
    import torch

    from . import __version__, cpu_cache_stats
    from ._core import extension
    from ._core.platform import cpu_name

    rows = [
        ("rlvr_kernels", __version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("C++ kernels", _extension_state()),
        ("C++ toolchain", extension.toolchain_problem() or "c++ compiler and ninja found"),
        ("triton", _triton_mode()),
        ("cpu", f"{cpu_name()}, {torch.get_num_threads()} torch threads"),
        ("cuda", torch.cuda.get_device_name() if torch.cuda.is_available() else "not available"),
        ("cpu output cache", "{cached_bytes} B cached, limit {limit_bytes} B".format(**cpu_cache_stats())),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_check(args) -> int:
    import torch

    from ._core import dispatch as _dispatch
    from .testing import CHECK_SUITES, run_checks

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backends = args.backend or _dispatch.available_backends(device)
    suites = {name: s for name, s in CHECK_SUITES.items() if args.op is None or name in args.op}
    total = sum(suite.count() for suite in suites.values()) * len(backends)
    done = [0]

    def progress():
        done[0] += 1
        print(f"\r  checking {done[0]}/{total}", end="", file=sys.stderr, flush=True)

    rows = run_checks(suites, backends, device=device, seed=args.seed, progress=progress)
    print("", file=sys.stderr)
    header = f"{'op':<20} {'backend':<9} {'case':<44} {'max abs err':>11} {'max rel err':>11}  result"
    print(header)
    print("-" * len(header))
    for r in rows:
        status = "pass" if r.ok else f"FAIL ({r.note})"
        print(f"{r.op:<20} {r.backend:<9} {r.case[:44]:<44} {r.max_abs:>11.2e} {r.max_rel:>11.2e}  {status}")
    failed = sum(not r.ok for r in rows)
    print(f"\n{len(rows) - failed}/{len(rows)} passed on {device} (backends: {', '.join(backends)})")
    return 1 if failed else 0


def cmd_bench(args) -> int:
    from .bench import run_all

    return run_all(out_dir=args.out, device=args.device, quick=args.quick, ops=args.op)


# The op families `check` and `bench` select with --op (`bench` adds the trainer steps).
OP_FAMILIES = ("group_advantages", "policy_loss", "linear_logprobs", "packing", "rollout_mismatch")


def main(argv=None) -> int:
    _reexec_with_triton_interpreter(argv)
    from ._core.dispatch import BACKENDS

    parser = argparse.ArgumentParser(prog="rlvr-kernels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, where the C++ kernels are built, Triton mode, device")
    p = sub.add_parser("build", help="compile the C++ CPU kernels now (else on first use); prints the library's path")
    p.add_argument("--sanitize", action="store_true", help="the AddressSanitizer + UBSan build (for make sanitize)")
    p.add_argument("--verbose", action="store_true", help="show the compiler commands")
    p = sub.add_parser("check", help="every op x backend against the fp64 reference")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--backend", action="append", choices=list(BACKENDS), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--op",
        action="append",
        choices=list(OP_FAMILIES),
        default=None,
        help="only these op families (repeatable; default: every one)",
    )
    p = sub.add_parser("bench", help="benchmark table, plot and result files")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"), help="where result files go")
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke test, not for reporting)")
    p.add_argument(
        "--op",
        action="append",
        choices=[*OP_FAMILIES, "trainer"],
        default=None,
        help="only these op families (repeatable); the result files are then named <date>-<device>-<ops>",
    )
    args = parser.parse_args(argv)
    return {"info": cmd_info, "build": cmd_build, "check": cmd_check, "bench": cmd_bench}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
