"""Correctness harness shared by the test suite and ``rlvr-kernels check``: the tolerance
rule (``_compare``), per-op random cases, runners and comparisons (``advantages``,
``policy_loss``, ``logprobs``), and ``CHECK_SUITES``, the registry the CLI iterates."""

from __future__ import annotations

from . import advantages, logprobs, packing, policy_loss, rollout_mismatch
from ._checks import CheckRow, CheckSuite, check_row, run_checks
from ._compare import Comparison, as_float64, compare, default_atol
from .advantages import check_group_advantages, compare_advantages, random_advantage_case
from .logprobs import (
    check_logprobs,
    compare_logprobs,
    logit_scale,
    logits_case_from,
    logprobs_upstream,
    random_logprobs_case,
    run_logprobs,
)
from .policy_loss import check_policy_loss, compare_policy, random_policy_case, run_policy_loss, upstream_for

# The suites ``rlvr-kernels check`` runs, in order: one per op family.
CHECK_SUITES = {
    suite.name: suite
    for suite in (advantages.SUITE, policy_loss.SUITE, logprobs.SUITE, packing.SUITE, rollout_mismatch.SUITE)
}

__all__ = [
    "CHECK_SUITES",
    "CheckRow",
    "CheckSuite",
    "Comparison",
    "as_float64",
    "check_group_advantages",
    "check_logprobs",
    "check_policy_loss",
    "check_row",
    "compare",
    "compare_advantages",
    "compare_logprobs",
    "compare_policy",
    "default_atol",
    "logit_scale",
    "logits_case_from",
    "logprobs_upstream",
    "random_advantage_case",
    "random_logprobs_case",
    "random_policy_case",
    "run_checks",
    "run_logprobs",
    "run_policy_loss",
    "upstream_for",
]
