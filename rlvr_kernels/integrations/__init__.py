"""Drop-in replacements with the peers' exact signatures (``verl``, ``trl``, ``openrlhf``, ``areal``), and
``apply()`` / ``unapply()`` that put the fused ops into the peers' trainers.

Importing these modules does not import the peers: they only reproduce their numbers.
Every integration's ``apply()`` is a declared list of (owner, attribute, replacement)
and the peer's tested version range, run by ``_patch.Integration`` (all or nothing,
identical objects back on ``unapply()``); the drop-ins that reproduce a peer function in
plain torch (KL estimators, loss aggregation) share one implementation, ``_torch_math``.
``call_counts()`` returns the calls of every patched entry point when counting is on
(``apply(count_calls=True)`` or ``RLVR_KERNELS_COUNT_CALLS=1``).
"""

from ._patch import PatchError, call_counts, reset_call_counts, set_counting

__all__ = ["PatchError", "call_counts", "reset_call_counts", "set_counting"]
