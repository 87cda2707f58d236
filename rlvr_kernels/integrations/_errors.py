"""Errors that name the caller's arguments, for every integration.

A drop-in calls an op whose arguments have the op's names (``targets``, ``logprobs``,
``scores``); its caller passed TRL's or verl's (``index``, ``per_token_logps``,
``rewards_per_func``). :func:`caller_names` re-raises the op's errors with the names the
caller knows.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Callable, Iterator, Mapping, Tuple


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
