"""Drop-in replacements with the peers' exact signatures (``verl``, ``trl``), and
``apply()`` / ``unapply()`` that put the fused ops into the peers' trainers.

Importing these modules does not import the peers: they only reproduce their numbers.
``call_counts()`` returns the calls of every patched entry point when counting is on
(``apply(count_calls=True)`` or ``RLVR_KERNELS_COUNT_CALLS=1``).
"""

from ._patch import PatchError, call_counts, reset_call_counts, set_counting

__all__ = ["PatchError", "call_counts", "reset_call_counts", "set_counting"]
