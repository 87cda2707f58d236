"""Importing the peers' own loss code in tests, where their packages pull in GPU-only modules.

``openrlhf.models`` imports ``flash_attn`` (CUDA-only, not installable on a CPU machine) at
module level; the policy loss and KL estimators do not call it. :func:`import_openrlhf_models`
registers stand-in modules for the names imported and then imports the real
``openrlhf.models.loss`` and ``openrlhf.models.utils``. The four ``flash_attn.bert_padding``
helpers that OpenRLHF's packed ``Actor.forward`` calls (``unpad_input``, ``pad_input``,
``index_first_axis``, ``rearrange``) are pure index operations, given here in torch (einops'
``rearrange``), so the packed layout runs on the CPU; ``flash_attn.utils.distributed.all_gather``
(ring attention) is a placeholder that raises if called.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import sys
import types
from typing import Iterator

_FLASH_ATTN = {
    "flash_attn": (),
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils": (),
    "flash_attn.utils.distributed": ("all_gather",),
}


def _index_first_axis(x, indices):
    return x[indices]


def _unpad_input(hidden_states, attention_mask, unused_mask=None):
    """flash_attn's ``unpad_input``: the rows of the valid positions (row-major), their flat
    indices, the int32 cumulative sequence lengths, the longest length, the lengths."""
    import torch

    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), seqlens


def _pad_input(hidden_states, indices, batch, seqlen):
    """flash_attn's ``pad_input``: the rows back at their flat indices, zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    return out.index_put((indices,), hidden_states).reshape(batch, seqlen, *hidden_states.shape[1:])


def _rearrange(*args, **kwargs):
    import einops

    return einops.rearrange(*args, **kwargs)


# Stand-ins that compute (the rest of _FLASH_ATTN are placeholders that raise).
_WORKING = {
    ("flash_attn.bert_padding", "index_first_axis"): _index_first_axis,
    ("flash_attn.bert_padding", "unpad_input"): _unpad_input,
    ("flash_attn.bert_padding", "pad_input"): _pad_input,
    ("flash_attn.bert_padding", "rearrange"): _rearrange,
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
            setattr(mod, a, _WORKING.get((name, a)) or _unavailable(f"{name}.{a}"))
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)


@contextlib.contextmanager
def stubbed_modules(spec: dict) -> Iterator[None]:
    """:func:`stub_modules` for the block only: the placeholders it registered are removed
    from ``sys.modules`` after it (a module imported inside keeps its references), so that
    other libraries' availability checks (``importlib.util.find_spec``) do not see them."""
    before = set(sys.modules)
    stub_modules(spec)
    added = [name for name in spec if name in sys.modules and name not in before]
    try:
        yield
    finally:
        for name in added:
            if isinstance(sys.modules.get(name), types.ModuleType) and sys.modules[name].__spec__.origin is None:
                del sys.modules[name]


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


# What ``areal.trainer.ppo.actor`` imports at module level that its loss and advantage code
# never calls: AReaL's experiment-tracking backends (``areal.utils.stats_logger``: swanlab,
# trackio, tensorboardX), tabulate and pybase64 (its RPC serialisation).
_AREAL_ACTOR = {
    "swanlab": (),
    "trackio": (),
    "tensorboardX": ("SummaryWriter",),
    "tabulate": ("tabulate",),
    "pybase64": (),
}


def import_areal_actor():
    """AReaL 1.0.4's ``areal.trainer.ppo.actor`` (``grpo_loss_fn``, ``PPOActor``), with
    placeholders for the packages it imports but its loss and advantage code do not call,
    only around the import (:func:`stubbed_modules`)."""
    with stubbed_modules(_AREAL_ACTOR):
        return importlib.import_module("areal.trainer.ppo.actor")
