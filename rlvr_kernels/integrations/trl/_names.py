"""The op's argument names -> TRL's, for the errors of the TRL functions
(``integrations._errors.caller_names``)."""

# group_advantages' argument names -> TRL's
ADV_NAMES = {"scores": "rewards_per_func", "group_size": "num_generations", "scale": "scale_rewards"}

# policy_loss' argument (and option) names -> grpo_loss_trl's (TRL's)
LOSS_NAMES = {
    "logprobs": "per_token_logps",
    "old_logprobs": "old_per_token_logps",
    "mask": "completion_mask",
    "ref_logprobs": "ref_per_token_logps",
    "entropy": "entropies",
    "global_num_tokens": "num_items_in_batch",
    "loss_scale_factor": "max_completion_length",
    "clip_low": "epsilon_low",
    "clip_high": "epsilon_high",
    "clip_ratio_c": "delta",
    "kl_coef": "beta",
    "tau_pos": "sapo_temperature_pos",
    "tau_neg": "sapo_temperature_neg",
    "entropy_quantile": "top_entropy_quantile",
}
