"""Op layer: one module per op family (validation, torch.library custom ops, dispatch to
the kernels through ``_core.dispatch``). The public functions are re-exported by the top-level
package; this package re-exports nothing, so ``rlvr_kernels.ops.policy_loss`` is always
the module, never the function of the same name."""
