"""Importing the peers' own loss code in tests, where their packages pull in GPU-only modules.

``openrlhf.models`` imports ``flash_attn`` (CUDA-only, not installable on a CPU machine) at
module level; the policy loss and KL estimators do not call it. :func:`import_openrlhf_models`
registers placeholder modules for the names imported (each raising if called) and then
imports the real ``openrlhf.models.loss`` and ``openrlhf.models.utils``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

_FLASH_ATTN = {
    "flash_attn": (),
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils": (),
    "flash_attn.utils.distributed": ("all_gather",),
}


def _unavailable(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"{name}: flash_attn is a placeholder in this process (rlvr_kernels.testing.peers)")

    return call


def stub_modules(spec: dict) -> None:
    """Register placeholder modules ``{module name: attribute names}`` that are not importable;
    a module that imports for real is left alone."""
    for name, attrs in spec.items():
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__path__ = []  # a package, so that submodules resolve
        for a in attrs:
            setattr(mod, a, _unavailable(f"{name}.{a}"))
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)


def import_openrlhf_models():
    """``(openrlhf.models.loss, openrlhf.models.utils)`` with flash_attn stubbed."""
    stub_modules(_FLASH_ATTN)
    return importlib.import_module("openrlhf.models.loss"), importlib.import_module("openrlhf.models.utils")


def _package_without_init(name: str, directory: str) -> None:
    """Register package ``name`` at ``directory`` without running its ``__init__``."""
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__spec__.submodule_search_locations = [directory]
    mod.__path__ = [directory]
    sys.modules[name] = mod


def import_skyrl_ppo_utils():
    """SkyRL 0.3.0's ``skyrl.backends.skyrl_train.utils.ppo_utils`` on Python 3.11.

    The package ``__init__`` chain (``skyrl.backends`` → ``skyrl.tinker.types``) and
    ``skyrl.train.config`` build pydantic models over ``typing.TypedDict``, which pydantic
    refuses before Python 3.12; ``ppo_utils`` itself only names ``AlgorithmConfig`` in type
    hints. So the three packages on the way are registered without their ``__init__`` and
    ``skyrl.train.config`` by a placeholder holding ``AlgorithmConfig``; the loss functions
    read any object with the config's attributes (``types.SimpleNamespace``).
    """
    import os

    import skyrl

    root = os.path.dirname(skyrl.__file__)
    for name in ("skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.utils"):
        _package_without_init(name, os.path.join(root, *name.split(".")[1:]))
    if "skyrl.train.config" not in sys.modules:
        cfg = types.ModuleType("skyrl.train.config")
        cfg.__spec__ = importlib.machinery.ModuleSpec("skyrl.train.config", None)
        cfg.AlgorithmConfig = type("AlgorithmConfig", (types.SimpleNamespace,), {})
        sys.modules["skyrl.train.config"] = cfg
    return importlib.import_module("skyrl.backends.skyrl_train.utils.ppo_utils")
