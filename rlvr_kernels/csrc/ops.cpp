// Schemas of the C++ kernels. The public ops (namespace `rlvr_kernels`) are defined in
// Python (rlvr_kernels/ops/), validate their inputs and call these for CPU tensors.
#include <torch/extension.h>
#include <torch/library.h>

#include "advantages.h"
#include "alloc.h"
#include "logprobs.h"
#include "packing.h"
#include "packing_py.h"
#include "policy_loss.h"
#include "rollout_mismatch.h"
#include "support_bits.h"

TORCH_LIBRARY(rlvr_kernels_C, m) {
  m.def(
      "group_advantages(Tensor scores, Tensor? group_index, Tensor? valid, Tensor? lengths, Tensor? response_mask, "
      "Tensor? cu_seqlens, float[] fparams, int[] iparams, ScalarType out_dtype) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor)");
  m.def(
      "group_partials(Tensor scores, Tensor? group_index, Tensor? valid, Tensor? lengths, Tensor? response_mask, "
      "Tensor? cu_seqlens, float[] fparams, int[] iparams) -> Tensor");
  m.def(
      "group_apply(Tensor scores, Tensor? group_index, Tensor? valid, Tensor? lengths, Tensor? response_mask, "
      "Tensor? cu_seqlens, Tensor partials, float[] fparams, int[] iparams, ScalarType out_dtype) -> (Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "policy_loss_fwd(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor? mask, Tensor? ref_logprobs, "
      "Tensor? rollout_logprobs, Tensor? entropy, Tensor? cu_seqlens, Tensor? entropy_threshold, float[] fparams, "
      "int[] iparams, bool need_entropy_grad, Tensor? cov_selection=None, Tensor? seq_stats=None) -> (Tensor, Tensor, "
      "Tensor, Tensor)");
  m.def("policy_loss_grad(Tensor coef, Tensor up, ScalarType dtype) -> Tensor");
  m.def(
      "linear_logprobs_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor inv_temperature, Tensor row_ptr, "
      "Tensor sorted_targets, Tensor? support, float[] fparams, int[] iparams) -> (Tensor, Tensor)");
  m.def(
      "linear_logprobs_bwd(Tensor hidden, Tensor weight, Tensor? bias, Tensor inv_temperature, Tensor row_ptr, "
      "Tensor sorted_targets, Tensor sorted_grad, Tensor lse, Tensor entropy, Tensor? grad_entropy, Tensor? support, "
      "float[] fparams, int[] iparams) -> (Tensor, Tensor, Tensor)");
  m.def(
      "logprobs_from_logits_stats(Tensor logits, Tensor targets, Tensor inv_temperature, Tensor? support, "
      "float[] fparams, int[] iparams) -> (Tensor, Tensor)");
  m.def(
      "logprobs_from_logits_bwd(Tensor logits, Tensor targets, Tensor inv_temperature, Tensor grad_logp, Tensor lse, "
      "Tensor entropy, Tensor? grad_entropy, Tensor? support, float[] fparams, int[] iparams) -> Tensor");
  m.def(
      "logprobs_from_logits_bwd_(Tensor(a!) logits, Tensor targets, Tensor inv_temperature, Tensor grad_logp, "
      "Tensor lse, Tensor entropy, Tensor? grad_entropy, Tensor? support, float[] fparams, int[] iparams) -> ()");
  m.def(
      "linear_logprobs_threshold(Tensor hidden, Tensor weight, Tensor? bias, Tensor inv_temperature, Tensor top_k, "
      "Tensor top_p, Tensor min_p, float[] fparams, int[] iparams) -> Tensor");
  m.def(
      "logprobs_from_logits_threshold(Tensor logits, Tensor inv_temperature, Tensor top_k, Tensor top_p, "
      "Tensor min_p, float[] fparams, int[] iparams) -> Tensor");
  m.def(
      "rollout_mismatch_stats(Tensor train_logprobs, Tensor rollout_logprobs, Tensor? response_mask, "
      "Tensor? cu_seqlens, float[] fparams, int[] iparams) -> (Tensor, Tensor, Tensor)");
  m.def("support_bits(Tensor support_ids, Tensor support_offsets, int vocab) -> Tensor");
  m.def(
      "prefix_tree_build(Tensor tokens, Tensor cu_tokens, Tensor trained, Tensor group, Tensor order, Tensor row_cu, "
      "Tensor? token_values, Tensor? sample_values, bool next_key) -> Tensor[]");
  m.def("cpu_cache_stats() -> int[]", &rlvr::cpu_cache_stats);
  m.def("empty_cpu_cache() -> ()", &rlvr::empty_cpu_cache);
}

TORCH_LIBRARY_IMPL(rlvr_kernels_C, CPU, m) {
  m.impl("group_advantages", &rlvr::group_advantages_cpu);
  m.impl("group_partials", &rlvr::group_partials_cpu);
  m.impl("group_apply", &rlvr::group_apply_cpu);
  m.impl("policy_loss_fwd", &rlvr::policy_loss_fwd_cpu);
  m.impl("policy_loss_grad", &rlvr::policy_loss_grad_cpu);
  m.impl("linear_logprobs_stats", &rlvr::linear_logprobs_stats_cpu);
  m.impl("linear_logprobs_bwd", &rlvr::linear_logprobs_bwd_cpu);
  m.impl("logprobs_from_logits_stats", &rlvr::logprobs_from_logits_stats_cpu);
  m.impl("logprobs_from_logits_bwd", &rlvr::logprobs_from_logits_bwd_cpu);
  m.impl("logprobs_from_logits_bwd_", &rlvr::logprobs_from_logits_bwd_inplace_cpu);
  m.impl("linear_logprobs_threshold", &rlvr::linear_logprobs_threshold_cpu);
  m.impl("logprobs_from_logits_threshold", &rlvr::logprobs_from_logits_threshold_cpu);
  m.impl("rollout_mismatch_stats", &rlvr::rollout_mismatch_stats_cpu);
  m.impl("support_bits", &rlvr::support_bits_cpu);
  m.impl("prefix_tree_build", &rlvr::prefix_tree_build_cpu);
}

// Importable as a Python module too (rlvr_kernels._core.extension.module()); the ops above register
// when the library loads. The module holds what takes Python objects, which an op schema cannot:
// the readers of per-sample lists and the incremental trie (packing_py.cpp).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { rlvr::bind_packing(m); }
