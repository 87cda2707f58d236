"""Drop-ins for verl (0.9), built on the fused ops, one module per verl module:

==========================  ================================================================
``core_algos``              ``verl.trainer.ppo.core_algos``: the outcome-advantage estimators,
                            ``compute_policy_loss_{vanilla,gspo,cispo,sapo,gpg,``
                            ``dppo_tv,dppo_kl,geo_mean,dro,clip_cov,kl_cov,bypass_mode}``,
                            ``kl_penalty``, ``agg_loss``
``losses``                  ``verl.workers.utils.losses.ppo_loss`` as one fused call:
                            :func:`policy_loss_verl` (not a drop-in: padded tensors + config)
``rollout_corr_helper``     ``verl.trainer.ppo.rollout_corr_helper``: the rollout-correction
                            weights, rejection mask, both at once, and the off-policy metrics
``torch_functional``        ``verl.utils.torch_functional``: ``logprobs_from_logits``,
                            ``entropy_from_logits``
``kernel``                  ``verl.utils.kernel.linear_cross_entropy``
``transformer_impl``        ``verl.workers.engine.fsdp.transformer_impl``: the FSDP actor
                            engine's ``forward_step`` without the ``[tokens, vocab]`` logits
``_config``                 reading verl's actor config (parsed once per content)
``_advantages``             the body the advantage drop-ins share
``_losses``                 what the policy-loss drop-ins, ``losses`` and ``patch`` share
                            (the loss body, verl's names for the op's arguments)
``_rollout_corr``           verl's rollout-correction metrics as device tensors, and the
                            reading of bypass mode's ``rollout_correction`` config
``patch``                   :func:`apply` / :func:`unapply`: the drop-ins inside verl's trainer
                            and workers (registries, ``ppo_loss``, log-probs)
==========================  ================================================================

Each drop-in has verl's signature (names, order, defaults;
tests/integrations/test_signatures_verl.py) and verl's numbers (to 1e-6 in fp32; the
tests under tests/*/test_peers_verl.py run verl's own functions on the same inputs).
Everything is importable from here: ``from rlvr_kernels.integrations import verl;
verl.compute_policy_loss_vanilla(...)``.

Backend selection (the same for every integration): a drop-in's signature has no room
for a ``backend`` argument, so the drop-ins run on the backend of the innermost
``with use_backend("reference" | "cpu" | "triton" | "auto"):`` block (a process-wide
setting that torch.compile traces; "auto" outside any block). :func:`policy_loss_verl`, our
own function, also takes ``backend=`` (None: the ``use_backend`` one). ``kl_penalty``,
``agg_loss`` and ``compute_policy_loss_gpg`` are elementwise work plus one masked sum,
run as lean torch (no kernel), the same on every backend.
"""

from .._backend import use_backend
from .core_algos import (
    agg_loss,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    kl_penalty,
)
from .kernel import linear_cross_entropy
from .losses import policy_loss_verl
from .patch import apply, is_applied, unapply
from .rollout_corr_helper import (
    compute_offpolicy_metrics,
    compute_rollout_corr_metrics_from_logprobs,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from .torch_functional import entropy_from_logits, logprobs_from_logits

__all__ = [
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_gdpo_outcome_advantage",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_dro",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_bypass_mode",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rollout_correction_and_rejection_mask",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "kl_penalty",
    "agg_loss",
    "policy_loss_verl",
    "logprobs_from_logits",
    "entropy_from_logits",
    "linear_cross_entropy",
    "use_backend",
    "apply",
    "unapply",
    "is_applied",
]
