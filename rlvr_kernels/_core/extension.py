"""The C++ CPU kernels: compiled on first use against the torch they are loaded into.

The package ships the sources (``rlvr_kernels/csrc``), not a binary: a binary built against
one torch does not load into another, and the wheel is pure Python. :func:`load` compiles
them with ``torch.utils.cpp_extension.load`` (ninja) the first time, into a cache directory
named by everything the binary depends on, and loads the library from there afterwards::

    $RLVR_KERNELS_CACHE (default ~/.cache/rlvr_kernels) /
        <variant>-cp311-torch2.13.0+cpu-<key>/       key = sha256(torch, Python ABI, flags, sources)
            rlvr_kernels_C.so                        present only once complete
            src/, build/                             the compiled copy of the sources, build.ninja

Variants: ``release`` (portable ``-O3 -fopenmp``; ``RLVR_KERNELS_NATIVE=1`` adds
``-march=native`` and so gets its own key) and ``sanitize`` (AddressSanitizer + UBSan, for
``make sanitize``). ``RLVR_KERNELS_EXTENSION=<path to .so>`` loads that build instead and
compiles nothing. A file lock per cache directory makes concurrent first uses (pytest-xdist
workers, DDP ranks) compile once; the others wait and load the result.

Only the C++ kernels need a compiler: the Triton kernels and ``backend="reference"`` never
call this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Optional, Tuple

import torch

ENV_CACHE = "RLVR_KERNELS_CACHE"
ENV_EXTENSION = "RLVR_KERNELS_EXTENSION"
ENV_NATIVE = "RLVR_KERNELS_NATIVE"
VARIANTS = ("release", "sanitize")
# The library's name: the TORCH_EXTENSION_NAME of csrc/ops.cpp and the file name in the cache.
# The ops register under the TORCH_LIBRARY namespace ``rlvr_kernels_C`` whatever it is called.
NAME = "rlvr_kernels_C"
LIB_FILE = NAME + ".so"

_log = logging.getLogger("rlvr_kernels")
_loaded: Dict[str, None] = {}
_modules: Dict[str, ModuleType] = {}
_failed: Optional[BaseException] = None


class ExtensionUnavailable(RuntimeError):
    """No C++ compiler or no ninja here: the C++ kernels cannot be compiled."""


def source_dir() -> Path:
    """The shipped C++ sources (``rlvr_kernels/csrc``)."""
    return Path(__file__).resolve().parent.parent / "csrc"


def _source_files() -> List[Path]:
    files = sorted(p for p in source_dir().iterdir() if p.suffix in (".cpp", ".h"))
    if not any(p.suffix == ".cpp" for p in files):
        raise RuntimeError(f"rlvr_kernels: no C++ sources in {source_dir()} (a broken install?)")
    return files


def sources_digest() -> str:
    """sha256 over the names and contents of every ``.cpp``/``.h`` file of :func:`source_dir`."""
    h = hashlib.sha256()
    for p in _source_files():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def flags(variant: str = "release") -> Tuple[List[str], List[str]]:
    """(compiler flags, linker flags) of a variant, beyond what torch's ``load`` adds
    (``-fPIC``, the C++ standard its headers need, include paths, the ABI macro)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    # Portable: no -march=native, the binary may be shared through a cache on several machines.
    # -DNDEBUG keeps torch's debug-only header asserts off, as in a setuptools build (which
    # takes it from Python's CFLAGS).
    cflags = ["-O3", "-DNDEBUG", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
    ldflags = ["-fopenmp"]
    if variant == "sanitize":
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
        # -fno-wrapv: with -fwrapv (Python's CFLAGS, inherited by setuptools builds) signed
        # overflow is defined behaviour and UBSan does not instrument it.
        cflags = [f for f in cflags if f != "-O3"] + ["-O1", "-fno-wrapv"] + san
        ldflags += san
    if os.environ.get(ENV_NATIVE) == "1":
        cflags.append("-march=native")
    return cflags, ldflags


def cache_root() -> Path:
    """``$RLVR_KERNELS_CACHE``, default ``~/.cache/rlvr_kernels``."""
    root = os.environ.get(ENV_CACHE)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "rlvr_kernels"


def _compiler() -> str:
    # What torch's load() runs (torch.utils.cpp_extension.get_cxx_compiler).
    return os.environ.get("CXX", "c++")


def cache_key(variant: str = "release", *, torch_version: Optional[str] = None, digest: Optional[str] = None) -> str:
    """The cache directory's name: ``<variant>-<python tag>-torch<version>-<16 hex>``, the hex
    a sha256 of everything the binary depends on (torch's version and commit, the Python ABI
    and platform, the compiler command, the flags, the sources). ``torch_version`` and
    ``digest`` (of the sources) override the current ones."""
    torch_version = torch.__version__ if torch_version is None else torch_version
    digest = sources_digest() if digest is None else digest
    cflags, ldflags = flags(variant)
    material = [
        torch_version,
        str(getattr(torch.version, "git_version", "")),
        str(torch.version.cuda),
        str(torch._C._GLIBCXX_USE_CXX11_ABI),
        sys.implementation.cache_tag,
        str(sysconfig.get_config_var("EXT_SUFFIX")),
        sysconfig.get_platform(),
        _compiler(),
        " ".join(cflags),
        " ".join(ldflags),
        digest,
    ]
    h = hashlib.sha256("\n".join(material).encode()).hexdigest()[:16]
    tag = sys.implementation.cache_tag.replace("cpython-", "cp")
    return f"{variant}-{tag}-torch{torch_version}-{h}"


def cache_dir(variant: str = "release") -> Path:
    return cache_root() / cache_key(variant)


def library_path(variant: str = "release") -> Path:
    """Where the variant's library is (or will be, once built)."""
    return cache_dir(variant) / LIB_FILE


def toolchain_problem() -> Optional[str]:
    """Why the C++ kernels cannot be compiled here (a missing compiler or ninja), or None."""
    missing = []
    cxx = _compiler()
    if shutil.which(cxx.split()[0]) is None:
        missing.append(f"a C++ compiler with OpenMP ({cxx!r} not found; e.g. `apt install g++`, or set CXX)")
    with _ninja_on_path():
        if shutil.which("ninja") is None:
            missing.append("ninja (`pip install ninja`)")
    if not missing:
        return None
    return (
        "rlvr_kernels compiles its C++ CPU kernels on first use and needs "
        + " and ".join(missing)
        + ". Install them, then run `rlvr-kernels build`. The Triton (GPU) kernels and "
        "backend='reference' need neither."
    )


@contextlib.contextmanager
def _ninja_on_path():
    """PATH plus the directories a pip-installed ninja lives in (the environment's bin/,
    which is not on PATH when its python runs without the environment activated)."""
    extra = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package: the binary and its location

        extra.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    old = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([*(old.split(os.pathsep) if old else []), *extra])
    try:
        yield
    finally:
        if old is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = old


def build(variant: str = "release", verbose: bool = False) -> Path:
    """Compile the variant into its cache directory unless it is there, and return the
    library's path. Never loads it (a sanitizer build aborts a process that did not preload
    the sanitizer runtimes). Raises :class:`ExtensionUnavailable` without a compiler or
    ninja, RuntimeError (with the compiler's output) when compiling fails."""
    out = cache_dir(variant)
    lib = out / LIB_FILE
    if lib.is_file():
        return lib
    problem = toolchain_problem()
    if problem:
        raise ExtensionUnavailable(problem)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(
            f"rlvr_kernels: cannot create the C++ kernels' cache {out} ({exc}): set {ENV_CACHE} to a writable directory"
        ) from exc
    from filelock import FileLock  # a torch dependency; the lock is released if the holder dies

    with FileLock(str(out) + ".lock"):
        if lib.is_file():  # another process built it while this one waited
            return lib
        _log.warning("rlvr_kernels: compiling the C++ CPU kernels into %s (once per torch/source version)", out)
        _compile(variant, out, verbose)
    return lib


def _compile(variant: str, out: Path, verbose: bool) -> None:
    from torch.utils import cpp_extension

    # Compile a private copy, so the sources hashed into the key are the ones compiled and
    # build.ninja names the same paths wherever the package is installed.
    src, bld = out / "src", out / "build"
    for d in (src, bld):  # leftovers of an interrupted build (torch's own lock file among them)
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    for p in _source_files():
        shutil.copy2(p, src / p.name)
    cflags, ldflags = flags(variant)
    # load() would dlopen the result: build only (see build()); the caller loads it.
    real_load_library = torch.ops.load_library
    torch.ops.load_library = lambda path: None
    try:
        with _ninja_on_path():
            cpp_extension.load(
                name=NAME,
                sources=[str(p) for p in sorted(src.glob("*.cpp"))],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                extra_include_paths=[str(src)],
                build_directory=str(bld),
                is_python_module=False,
                verbose=verbose,
            )
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"rlvr_kernels: compiling the C++ kernels ({variant}) in {bld} failed: {exc}") from exc
    finally:
        torch.ops.load_library = real_load_library
    # torch names a rebuild in the same process <name>_v<n>: take the newest library.
    built = max(bld.glob(NAME + "*.so"), key=lambda p: p.stat().st_mtime)
    tmp = out / (LIB_FILE + ".tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, out / LIB_FILE)  # atomic: the library appears only when complete


def load() -> Path:
    """Load the C++ kernels into this process (the ``torch.ops.rlvr_kernels_C`` ops) and
    return the library's path: ``$RLVR_KERNELS_EXTENSION`` if set (compiling nothing), else
    the release build, compiled first if not cached. Raises FileNotFoundError for a
    ``RLVR_KERNELS_EXTENSION`` that names no file, :class:`ExtensionUnavailable` without a
    compiler, RuntimeError when compiling fails (once per process: a failed compile is not
    retried)."""
    global _failed
    env = os.environ.get(ENV_EXTENSION)
    if env:
        path = Path(env)
        if not path.is_file():
            raise FileNotFoundError(
                f"{ENV_EXTENSION}={env!r}: no such file. It names a prebuilt rlvr_kernels C++ library "
                f"(e.g. the output of `rlvr-kernels build`); unset it to compile on first use."
            )
    else:
        if _failed is not None:
            raise _failed
        try:
            path = build("release")
        except RuntimeError as exc:
            _failed = exc
            raise
    key = str(path.resolve())
    if key not in _loaded:
        torch.ops.load_library(key)
        _loaded[key] = None
    return path


def module() -> ModuleType:
    """The loaded library as a Python module: what takes Python objects, which an op schema
    cannot (the packing readers of per-sample lists and arrays, the incremental trie). The same
    file as the ops (its ``PYBIND11_MODULE``), so one build serves both."""
    key = str(load().resolve())
    if key not in _modules:
        spec = importlib.util.spec_from_file_location(NAME, key)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _modules[key] = mod
    return _modules[key]


def loaded() -> List[str]:
    """The libraries :func:`load` loaded into this process."""
    return list(_loaded)
