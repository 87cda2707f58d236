"""verl 0.9.1's rejection criteria (``rollout_rs``) with thresholds that reject some of
the tests' random sequences but not all: every single criterion, and chains of them
(comma-separated, one threshold each). Shared by the tests that diff RolloutCorrection
and the verl drop-ins against verl's ``compute_rollout_rejection_mask``."""

RS_CHAINS = [
    ("token_k1", "2.0"),
    ("token_k2", 0.05),
    ("token_k3", 0.05),
    ("seq_sum_k1", "0.3_3.0"),
    ("seq_sum_k2", 0.4),
    ("seq_sum_k3", 0.4),
    ("seq_mean_k1", "0.8_1.25"),
    ("seq_mean_k2", 0.05),
    ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.3),
    ("seq_max_k3", 0.3),
    ("token_k1,seq_mean_k3", "0.5_2.0,0.06"),
    ("token_k2,seq_sum_k1,seq_max_k3", "0.1,3.0,0.4"),
]
