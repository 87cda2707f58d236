"""Putting the fused ops into a peer's trainer and taking them out again, for every
integration (``integrations.trl.apply``, ``integrations.verl.apply``).

A :class:`Patcher` replaces named attributes of a peer's modules and classes, remembers
each original object, and :meth:`Patcher.restore` puts every one back (the identical
objects, so ``unapply()`` restores the stock trainer bit for bit). A name that is not
where the tested peer version keeps it raises :class:`PatchError` before anything is
replaced: a moved name is an error, never a silently unpatched trainer.

Call counting (a debug mode, off by default): with ``set_counting(True)`` or the
environment variable ``RLVR_KERNELS_COUNT_CALLS=1``, every patched entry point records
its calls under a stable name (``record``); :func:`call_counts` returns them. The tests
read it to prove that each drop-in actually ran inside the trainer.
"""

from __future__ import annotations

import collections
import importlib
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "PatchError",
    "Patcher",
    "call_counts",
    "check_version",
    "record",
    "reset_call_counts",
    "set_counting",
]


class PatchError(RuntimeError):
    """A peer's name is not where the tested version keeps it, or its version is outside
    the tested range (with ``strict=True``)."""


_MISSING = object()
_lock = threading.Lock()
_counts: "collections.Counter[str]" = collections.Counter()
_counting = os.environ.get("RLVR_KERNELS_COUNT_CALLS", "") not in ("", "0")


def set_counting(enabled: bool) -> None:
    """Turn call counting on or off (process-wide)."""
    global _counting
    _counting = bool(enabled)


def record(name: str) -> None:
    """Count one call of the patched entry point ``name`` (a no-op unless counting is on)."""
    if _counting:
        with _lock:
            _counts[name] += 1


def call_counts() -> Dict[str, int]:
    """Calls of each patched entry point since the last reset (counting must be on)."""
    with _lock:
        return dict(_counts)


def reset_call_counts() -> None:
    with _lock:
        _counts.clear()


def check_version(package: str, installed: str, low: str, high: str, *, strict: bool) -> None:
    """``low <= installed < high`` or, with ``strict``, a PatchError naming the range (a
    warning without). The patches read private names of the peer, which move between
    releases: outside the tested range they may no longer be where apply() looks."""
    import warnings

    v = _release(installed)
    if v is not None and _release(low) <= v < _release(high):
        return
    message = (
        f"{package} {installed} is outside the range rlvr_kernels' integration is tested with "
        f"({low} <= version < {high})"
    )
    if strict:
        raise PatchError(message + "; pass strict=False to patch it anyway (with a warning)")
    warnings.warn(message + "; patching anyway (strict=False)", RuntimeWarning, stacklevel=3)


def _release(version: str) -> Optional[Tuple[int, ...]]:
    """The release numbers of a version string ("1.16.0.dev0" -> (1, 16, 0)); None when
    it does not start with one."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts) + (0,) * (3 - len(parts)) if parts else None


class Patcher:
    """Replaces attributes and restores them in reverse order. ``owner`` is a module,
    a class, or a dotted module path (imported on use)."""

    def __init__(self, name: str):
        self.name = name
        self._saved: List[Tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    @staticmethod
    def resolve(owner: Any) -> Any:
        if isinstance(owner, str):
            try:
                return importlib.import_module(owner)
            except ImportError as e:
                raise PatchError(f"cannot import {owner}: {e}") from e
        return owner

    @staticmethod
    def lookup(owner: Any, attr: str) -> Any:
        """The object under ``owner.attr`` as stored (a class's own ``__dict__`` entry, so
        staticmethods stay staticmethods), or a PatchError naming where it was looked for."""
        owner = Patcher.resolve(owner)
        if isinstance(owner, type):
            for klass in owner.__mro__:
                if attr in vars(klass):
                    return vars(klass)[attr] if klass is owner else getattr(owner, attr)
        elif hasattr(owner, attr):
            return getattr(owner, attr)
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        raise PatchError(f"{where}.{attr} not found: the peer moved or renamed it (checked before patching)")

    def replace(self, owner: Any, attr: str, new: Any) -> Any:
        """Set ``owner.attr = new``; returns the original (looked up first, so a missing
        name raises before anything changes)."""
        owner = self.resolve(owner)
        self.lookup(owner, attr)
        own = vars(owner).get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr)
        self._saved.append((owner, attr, own))
        setattr(owner, attr, new)
        return own

    def restore(self) -> None:
        """Put back every original, last replaced first; an attribute a class only
        inherited is deleted again."""
        while self._saved:
            owner, attr, original = self._saved.pop()
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)

    def originals(self) -> Dict[str, Any]:
        return {f"{getattr(o, '__name__', o)}.{a}": orig for o, a, orig in self._saved}


def optional_import(module: str) -> Optional[Any]:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
