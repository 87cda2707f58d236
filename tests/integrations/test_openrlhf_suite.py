"""OpenRLHF 0.11.2's own shipped tests (its wheel's ``tests/``) run against the drop-ins.

Each shipped module loads OpenRLHF's source from files into a private package and binds the
names it tests at module level (``PolicyLoss``, ``compute_approx_kl``, ``Actor``). This module
loads it the same way and rebinds those names to ours, then collects its test functions (their
parametrisations included):

- ``tests/test_loss_aggregation.py``: ``PolicyLoss`` is ours (``aggregate_loss`` and
  ``openrlhf.utils.loss_utils`` stay OpenRLHF's: no drop-in replaces them);
- ``tests/test_kl_estimator_gradient.py``: ``compute_approx_kl`` is ours;
- ``tests/test_actor_entropy_temperature.py``: the loaded ``Actor`` gets our ``forward`` and its
  module our ``compute_entropy`` / ``log_probs_from_logits`` (its table LM has no LM head, so
  the logits path runs, on the drop-ins).

Every collected test must call a drop-in (call counting), except the ones in
``NO_DROPIN`` that test only OpenRLHF's loss-batch bookkeeping. The other shipped modules test
the data pipeline, Ray, vLLM, checkpointing or the experience maker (whose advantage code has
no drop-in yet) and are not run here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import sys

import pytest

from rlvr_kernels.integrations import call_counts, reset_call_counts, set_counting
from rlvr_kernels.integrations import openrlhf as ours
from rlvr_kernels.integrations.openrlhf.actor import make_forward
from rlvr_kernels.testing.peers import import_openrlhf_models

import_openrlhf_models()  # flash_attn stand-ins, and deepspeed / peft imported for real


def _shipped(name: str):
    files = importlib.metadata.files("openrlhf") or []
    path = next((f for f in files if str(f) == f"tests/{name}.py"), None)
    assert path is not None, f"openrlhf's wheel no longer ships tests/{name}.py"
    path = pathlib.Path(path.locate())
    spec = importlib.util.spec_from_file_location(f"_openrlhf_shipped_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_agg = _shipped("test_loss_aggregation")
_agg.PolicyLoss = ours.PolicyLoss
_kl = _shipped("test_kl_estimator_gradient")
_kl.compute_approx_kl = ours.compute_approx_kl
_ent = _shipped("test_actor_entropy_temperature")
_actor_module = sys.modules[_ent.Actor.__module__]
_actor_module.compute_entropy = ours.compute_entropy
_actor_module.log_probs_from_logits = ours.log_probs_from_logits
_ent.Actor.forward = make_forward(_ent.Actor.forward, strict=True)

COLLECTED = {}
for _module in (_agg, _kl, _ent):
    for _name, _fn in vars(_module).items():
        if _name.startswith("test_") and callable(_fn):
            assert _name not in COLLECTED, _name
            COLLECTED[_name] = _fn
globals().update(COLLECTED)

# shipped tests of aggregate_loss / get_loss_batch_info / iter_grad_accum_global_norm only
NO_DROPIN = {
    "test_token_mean_aggregation_matches_verl_dp_average",
    "test_seq_mean_token_mean_aggregation_matches_verl_dp_average",
    "test_loss_batch_info_excludes_fully_masked_sequences",
    "test_grad_accum_global_norm_matches_global_token_mean_over_window",
    "test_grad_accum_global_norm_differs_from_per_microbatch_when_uneven",
}


@pytest.fixture(autouse=True)
def _drop_ins_ran(request):
    set_counting(True)
    reset_call_counts()
    yield
    counts = call_counts()
    set_counting(False)
    name = request.node.originalname
    if name in NO_DROPIN:
        return
    assert any(k.startswith("openrlhf.") for k in counts), f"{name} called no drop-in: {counts}"


def test_the_shipped_suite_is_collected():
    """The three shipped modules are here, and the no-drop-in list names shipped tests."""
    assert len(COLLECTED) >= 20 and NO_DROPIN <= COLLECTED.keys()
    assert "test_entropy_matches_temperature_scaled_policy" in COLLECTED
    ours.PolicyLoss()  # (a drop-in call, for the fixture)
