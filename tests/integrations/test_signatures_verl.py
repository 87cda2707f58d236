"""Every verl drop-in has the signature of the live verl function it replaces (parameter
names, order, kinds and defaults), and lives in the module of ours that mirrors verl's
module (``verl.trainer.ppo.core_algos`` -> ``integrations.verl.core_algos``, ...)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import verl.utils.torch_functional as verl_F
from verl.trainer.ppo import core_algos as verl_core_algos
from verl.trainer.ppo import rollout_corr_helper as verl_rch
from verl.utils.kernel import linear_cross_entropy as verl_lce

from rlvr_kernels.integrations import verl as ours

# Our names that are not drop-ins: the actor loss (a fused ppo_loss taking padded tensors),
# the backend selector and apply() / unapply() / is_applied() (tests/integrations/test_verl_apply.py).
NOT_DROPINS = {"policy_loss_verl", "use_backend", "apply", "unapply", "is_applied"}


def _verl_function(name):
    """(our module, verl's function) for a drop-in name."""
    if hasattr(verl_core_algos, name):
        return "core_algos", getattr(verl_core_algos, name)
    if hasattr(verl_rch, name):
        return "rollout_corr_helper", getattr(verl_rch, name)
    if name in ("logprobs_from_logits", "entropy_from_logits"):
        return "torch_functional", getattr(verl_F, name)
    if name == "linear_cross_entropy":
        # verl's function is LinearCrossEntropy.apply, whose own signature is (*args, **kwargs):
        # the parameters are those of its forward after ctx.
        forward = inspect.signature(verl_lce.LinearCrossEntropy.forward)
        params = list(forward.parameters.values())[1:]
        return "kernel", forward.replace(parameters=params)
    raise AssertionError(f"{name}: no verl function known to replace")


DROPINS = [n for n in ours.__all__ if n not in NOT_DROPINS]


def _params(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", DROPINS)
def test_signature_equals_verl(name):
    module, theirs = _verl_function(name)
    theirs = theirs if isinstance(theirs, inspect.Signature) else inspect.signature(theirs)
    assert _params(inspect.signature(getattr(ours, name))) == _params(theirs)


@pytest.mark.parametrize("name", DROPINS)
def test_dropin_lives_where_verl_defines_it(name):
    module, _ = _verl_function(name)
    fn = getattr(ours, name)
    assert fn.__module__ == f"rlvr_kernels.integrations.verl.{module}", fn.__module__
    assert getattr(importlib.import_module(fn.__module__), name) is fn
    assert fn.__name__ == name


def test_every_name_is_exported_and_checked():
    """__all__ lists every public name of the package; the non-drop-ins are the known ones."""
    public = {n for n in dir(ours) if not n.startswith("_") and callable(getattr(ours, n))}
    assert public == set(ours.__all__)
    assert NOT_DROPINS <= set(ours.__all__)
    assert len(DROPINS) == 30


def test_use_backend_is_the_one_of_every_integration():
    from rlvr_kernels.integrations import _backend

    assert ours.use_backend is _backend.use_backend


def test_dropin_modules_hold_only_verls_names():
    """A module of ours named after a verl module defines, as public names, only names of
    that verl module (with verl's signatures, above); shared helpers live in private
    modules (``_advantages``, ``_losses``, ``integrations._torch_math``)."""
    theirs = {
        "core_algos": verl_core_algos,
        "torch_functional": verl_F,
        "kernel": verl_lce,
        "rollout_corr_helper": verl_rch,
    }
    for module, verl_module in theirs.items():
        mod = importlib.import_module(f"rlvr_kernels.integrations.verl.{module}")
        defined = {
            n
            for n, v in vars(mod).items()
            if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == mod.__name__
        }
        assert defined and all(hasattr(verl_module, n) for n in defined), (module, defined)
        assert set(mod.__all__) == defined
