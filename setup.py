"""Builds the C++ CPU kernels as ``rlvr_kernels._C``.

Portable by default (no ``-march=native``: wheels must run on other x86-64 and Arm
machines). ``RLVR_KERNELS_SANITIZE=1`` builds with AddressSanitizer and UBSan for
``make sanitize``; ``RLVR_KERNELS_NATIVE=1`` opts into ``-march=native`` for a local build.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# No -std here: torch adds the C++ standard its own headers need (C++20 for torch 2.13).
cxx_flags = ["-O3", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
link_flags = ["-fopenmp"]
if os.environ.get("RLVR_KERNELS_SANITIZE") == "1":
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
    cxx_flags = [f for f in cxx_flags if f != "-O3"] + ["-O1"] + san
    link_flags += san
if os.environ.get("RLVR_KERNELS_NATIVE") == "1":
    cxx_flags.append("-march=native")

setup(
    ext_modules=[
        CppExtension(
            name="rlvr_kernels._C",
            sources=sorted(glob.glob("csrc/*.cpp")),
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
