"""Every TRL drop-in has the signature of the live TRL function it replaces (parameter
names, order, kinds and defaults), and lives in the module of ours that mirrors TRL's
module (``trl.trainer.utils`` -> ``integrations.trl.trainer_utils``, ...).

TRL computes the GRPO advantages and loss inline (``GRPOTrainer`` methods, the async
rollout worker), so those three functions of ours have no TRL function to match: they
live in the module named after where TRL computes them, take TRL's names, and their
numbers are checked against TRL's own source (tests/*/test_peers_trl.py)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import trl.trainer.utils as trl_utils

from rlvr_kernels.integrations import trl as ours

# Ours, not drop-ins: where TRL computes each (our module mirrors it), and the backend selector.
NOT_DROPINS = {
    "compute_grpo_advantages": "grpo_trainer",  # GRPOTrainer._generate_and_score_completions
    "grpo_loss_trl": "grpo_trainer",  # GRPOTrainer._compute_loss
    "reduce_trl_metrics": "grpo_trainer",  # _compute_loss's metric logging
    "trl_entropy_threshold": "grpo_trainer",  # GRPOTrainer.get_high_entropy_mask's threshold
    "TrlMetric": "grpo_trainer",  # (grpo_loss_trl's metric type)
    "compute_async_grpo_advantages": "async_rollout_worker",  # trl.experimental.async_grpo
    "use_backend": None,
    # integrations.trl.patch: putting the ops into TRL's trainers (tests/integrations/test_trl_apply.py)
    "apply": None,
    "unapply": None,
    "is_applied": None,
    "applied_options": None,
}
# drop-in -> (our module, TRL's module)
TRL_MODULES = {"trainer_utils": trl_utils}

DROPINS = [n for n in ours.__all__ if n not in NOT_DROPINS]


def _trl_function(name):
    """(our module, TRL's function) for a drop-in name."""
    for module, theirs in TRL_MODULES.items():
        if hasattr(theirs, name):
            return module, getattr(theirs, name)
    raise AssertionError(f"{name}: no TRL function known to replace")


def _params(sig):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", DROPINS)
def test_signature_equals_trl(name):
    _, theirs = _trl_function(name)
    assert _params(inspect.signature(getattr(ours, name))) == _params(inspect.signature(theirs))


@pytest.mark.parametrize("name", DROPINS)
def test_dropin_lives_where_trl_defines_it(name):
    module, theirs = _trl_function(name)
    fn = getattr(ours, name)
    assert fn.__module__ == f"rlvr_kernels.integrations.trl.{module}", fn.__module__
    assert theirs.__module__ == "trl.trainer.utils"
    assert getattr(importlib.import_module(fn.__module__), name) is fn
    assert fn.__name__ == name


@pytest.mark.parametrize("name", [n for n, m in NOT_DROPINS.items() if m])
def test_inline_computations_live_where_trl_computes_them(name):
    fn = getattr(ours, name)
    assert fn.__module__ == f"rlvr_kernels.integrations.trl.{NOT_DROPINS[name]}", fn.__module__
    assert not any(hasattr(m, name) for m in TRL_MODULES.values())


def test_every_name_is_exported_and_checked():
    """__all__ lists every public function of the package; the drop-ins are TRL's three
    log-prob utilities."""
    public = {n for n in dir(ours) if not n.startswith("_") and callable(getattr(ours, n))}
    assert public == set(ours.__all__)
    assert set(NOT_DROPINS) <= set(ours.__all__)
    assert sorted(DROPINS) == ["entropy_from_logits", "selective_log_softmax", "selective_log_softmax_and_entropy"]


def test_entropy_requires_grad_is_taken_as_trl_takes_it():
    """The signature defect this test file exists for: TRL's third positional parameter is
    ``entropy_requires_grad``, not the temperature."""
    import torch

    logits = torch.randn(2, 3, 7, requires_grad=True)
    index = torch.randint(0, 7, (2, 3))
    for call in (
        lambda f: f(logits, index, False),
        lambda f: f(logits, index, entropy_requires_grad=False),
        lambda f: f(logits, index, False, 0.5),
    ):
        lp, ent = call(ours.selective_log_softmax_and_entropy)
        lp_t, ent_t = call(trl_utils.selective_log_softmax_and_entropy)
        assert not ent.requires_grad and not ent_t.requires_grad and lp.requires_grad
        torch.testing.assert_close(lp, lp_t, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent_t, rtol=1e-5, atol=1e-5)


def test_use_backend_is_the_one_of_every_integration():
    from rlvr_kernels.integrations import _backend

    assert ours.use_backend is _backend.use_backend


def test_chunked_logprob_function_apply_has_trls_signature():
    """``ChunkedLogProbFunction.apply`` takes what TRL's autograd Function's ``forward`` takes
    after ``ctx`` (names, order, kinds, defaults): TRL's fused LM head calls it positionally."""
    import trl.kernels as trl_kernels

    from rlvr_kernels.integrations.trl.kernels import OPTIONAL_OUTPUTS, ChunkedLogProbFunction

    theirs = _params(inspect.signature(trl_kernels.ChunkedLogProbFunction.forward))
    assert theirs[0][0] == "ctx"
    assert _params(inspect.signature(ChunkedLogProbFunction.apply)) == theirs[1:]
    assert OPTIONAL_OUTPUTS == trl_kernels.chunked_logprob.OPTIONAL_OUTPUTS


def test_dropin_modules_hold_only_their_names():
    """A module of ours named after a TRL module defines, as public names, only TRL's
    names there (trainer_utils) or the functions for TRL's inline code that it mirrors
    (grpo_trainer, async_rollout_worker); shared helpers live in private modules."""
    expected = {"trainer_utils": {n for n in DROPINS}}
    for name, module in NOT_DROPINS.items():
        if module:
            expected.setdefault(module, set()).add(name)
    for module, names in expected.items():
        mod = importlib.import_module(f"rlvr_kernels.integrations.trl.{module}")
        defined = {
            n
            for n, v in vars(mod).items()
            if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == mod.__name__
        }
        assert defined == names, (module, defined ^ names)
        assert set(mod.__all__) - {"TRL_LOSS_TYPES"} == names
