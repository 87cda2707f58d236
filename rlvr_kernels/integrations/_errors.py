"""Errors that name the caller's arguments, for every integration.

A drop-in calls an op whose arguments have the op's names (``targets``, ``logprobs``,
``scores``); its caller passed TRL's or verl's (``index``, ``per_token_logps``,
``rewards_per_func``). :func:`caller_names` re-raises the op's errors with the names the
caller knows.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from typing import Callable, Iterator, Mapping, Tuple

import torch

from .._core.validation import FLOAT_DTYPES, INDEX_DTYPES, check_tensor


@contextlib.contextmanager
def caller_names(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise a ValueError / TypeError / NotImplementedError from the block with the
    inner op's argument names (the keys of ``names``, as whole words) replaced by the
    caller's, so a drop-in's errors speak of the arguments its caller passed."""
    try:
        yield
    except (ValueError, TypeError, NotImplementedError) as e:
        if type(e) not in (ValueError, TypeError, NotImplementedError):
            raise
        message = str(e)
        renamed = _renamer(tuple(sorted(names.items())))(message)
        if renamed == message:
            raise
        raise type(e)(renamed).with_traceback(e.__traceback__) from None


@functools.lru_cache(maxsize=None)
def _renamer(pairs: Tuple[Tuple[str, str], ...]) -> Callable[[str], str]:
    table = dict(pairs)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in sorted(table, key=len, reverse=True)) + r")\b")
    return lambda message: pattern.sub(lambda m: table[m.group(1)], message)


def checked_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The peers' ``(logits [..., V], labels)`` pair checked, ``labels`` shaped like the
    logits' leading dimensions (any shape with that many elements is reshaped)."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    check_tensor("labels", labels, dtypes=INDEX_DTYPES)
    if logits.dim() < 1:
        raise ValueError("logits: expected a [..., V] tensor, got a 0-d tensor")
    lead = tuple(logits.shape[:-1])
    if tuple(labels.shape) != lead:
        if labels.numel() != math.prod(lead):
            raise ValueError(
                f"labels: expected one label per row of logits ({math.prod(lead)} for logits "
                f"{tuple(logits.shape)}), got shape {tuple(labels.shape)}"
            )
        labels = labels.reshape(lead)
    return labels


def no_labels(logits: torch.Tensor) -> torch.Tensor:
    """The peers' entropy-only ``logits [..., V]`` checked, and labels that score nothing
    (-100 on every row) for ``logprobs_from_logits(..., return_entropy=True)``."""
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    if logits.dim() < 1:
        raise ValueError("logits: expected a [..., V] tensor, got a 0-d tensor")
    return torch.full(logits.shape[:-1], -100, dtype=torch.int64, device=logits.device)
