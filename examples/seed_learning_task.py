"""The seed note's exercise: one group of binary rewards, advantages normalised by the
mean only (Dr.GRPO) and by mean and std (GRPO), then what a token-level loss receives.

    python examples/seed_learning_task.py
"""

import torch

import rlvr_kernels as rk

rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])  # 2 of 8 samples correct
lengths = torch.tensor([3, 5, 2, 4, 6, 1, 3, 2])
mask = (torch.arange(6)[None, :] < lengths[:, None]).float()

mean_only = rk.group_advantages(rewards, group_size=8, estimator="dr_grpo")
mean_std = rk.group_advantages(rewards, group_size=8, estimator="grpo", response_mask=mask)

print("rewards            ", rewards.tolist())
print("group mean / std   ", float(mean_std.group_mean), float(mean_std.group_std))
print("A, mean only       ", [round(a, 4) for a in mean_only.advantages.tolist()])
print("A, mean and std    ", [round(a, 4) for a in mean_std.advantages.tolist()])
print("token advantages (sample 0 and 1):")
print(mean_std.token_advantages[:2])
print(
    "Every valid token of a sample gets the same A_i: the sequence-level signal says nothing\n"
    "about which tokens mattered. Token-level shaping (sample polarity, A3PO) adds that from\n"
    "the tokens' probabilities under the policy, which this op does not see."
)
