"""Putting the fused ops into a peer's trainer and taking them out again, the one
mechanism of every integration (``integrations.trl.apply``, ``integrations.verl.apply``).

An integration declares what it replaces as a list of :class:`Target` entries
``(owner, attribute, replacement)`` and its peer's tested version range; an
:class:`Integration` does the rest, the same way for every peer:

1. undo its previous ``apply()`` (the last call wins, nothing is stacked);
2. gate on the peer's version (``strict=True``: outside the tested range raises
   :class:`PatchError`; ``strict=False``: a warning);
3. build the target list, then look up every owner and attribute, and build every
   replacement (a :class:`Build` is called with the object it replaces): a name that is
   not where the tested version keeps it, or a failing builder, raises before anything
   is set, so the peer is left untouched;
4. set every replacement (an error while setting puts back what was already set);
5. optionally sweep the peer's loaded modules for attributes that are the replaced
   objects (``is``), so that a module that imported one by name is patched too.

``unapply()`` restores the identical objects (``is``), last replaced first; an attribute
that was absent (an inherited one on a class, a missing registry key) is removed again.

Call counting (a debug mode, off by default): with ``set_counting(True)``,
``apply(count_calls=True)`` or the environment variable ``RLVR_KERNELS_COUNT_CALLS=1``,
every patched entry point records its calls under a stable name (``record``);
:func:`call_counts` returns them. The tests read it to prove that each drop-in actually
ran inside the trainer.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import sys
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = [
    "Build",
    "Integration",
    "Needs",
    "PatchError",
    "Patcher",
    "Target",
    "call_counts",
    "check_version",
    "record",
    "reset_call_counts",
    "set_counting",
    "uncounted",
]


class PatchError(RuntimeError):
    """A peer's name is not where the tested version keeps it, or its version is outside
    the tested range (with ``strict=True``)."""


_MISSING = object()
_lock = threading.Lock()
_counts: "collections.Counter[str]" = collections.Counter()
_counting = os.environ.get("RLVR_KERNELS_COUNT_CALLS", "") not in ("", "0")
_paused = threading.local()  # calls made by our own code on the step's behalf (a loss probe)


def set_counting(enabled: bool) -> None:
    """Turn call counting on or off (process-wide)."""
    global _counting
    _counting = bool(enabled)


def record(name: str) -> None:
    """Count one call of the patched entry point ``name`` (a no-op unless counting is on)."""
    if _counting and not getattr(_paused, "depth", 0):
        with _lock:
            _counts[name] += 1


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Calls in this block (on this thread) are not counted: the evaluations of the step's loss
    that the head makes to form its gradient are not the step's own calls."""
    _paused.depth = getattr(_paused, "depth", 0) + 1
    try:
        yield
    finally:
        _paused.depth -= 1


def call_counts() -> Dict[str, int]:
    """Calls of each patched entry point since the last reset (counting must be on)."""
    with _lock:
        return dict(_counts)


def reset_call_counts() -> None:
    with _lock:
        _counts.clear()


def check_version(package: str, installed: str, low: str, high: str, *, strict: bool, stacklevel: int = 3) -> None:
    """``low <= installed < high`` or, with ``strict``, a PatchError naming the range (a
    warning without, at ``stacklevel``). The patches read private names of the peer,
    which move between releases: outside the tested range they may no longer be where
    apply() looks."""
    v = _release(installed)
    if v is not None and _release(low) <= v < _release(high):
        return
    message = (
        f"{package} {installed} is outside the range rlvr_kernels' integration is tested with "
        f"({low} <= version < {high})"
    )
    if strict:
        raise PatchError(message + "; pass strict=False to patch it anyway (with a warning)")
    warnings.warn(message + "; patching anyway (strict=False)", RuntimeWarning, stacklevel=stacklevel)


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


def _installed_version(module: Any, package: str) -> str:
    """The module's ``__version__``, else its distribution's (OpenRLHF has no ``__version__``);
    "0" when neither is known."""
    version = getattr(module, "__version__", None)
    if version is None:
        import importlib.metadata

        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "0"
    return str(version)


# ---------------------------------------------------------------------------------------
# What an integration declares
# ---------------------------------------------------------------------------------------


class Build:
    """A replacement made from the object it replaces, ``factory(original)``, when
    apply() runs (after every lookup, before anything is set). Several targets may share
    one Build: it is called once, and every one of them must hold the identical original
    (else PatchError: the peer no longer imports that object by name there), so they all
    get the one replacement."""

    __slots__ = ("factory",)

    def __init__(self, factory: Callable[[Any], Any]):
        self.factory = factory

    def __repr__(self) -> str:
        return f"Build({getattr(self.factory, '__qualname__', self.factory)!r})"


class Target(NamedTuple):
    """``owner.attr`` becomes ``new`` (an object, or a :class:`Build`).

    ``owner``: a module, a class, a dict (a registry: ``attr`` is its key) or a dotted
    path, ``"package.module"`` or ``"package.module:Class"`` (imported on apply()).
    ``optional``: a dotted owner that cannot be imported (another engine's module, whose
    extra packages are not installed) is skipped; one that imports must have ``attr``.
    ``missing_ok``: ``attr`` may be absent; it is added and removed again on restore."""

    owner: Any
    attr: str
    new: Any
    optional: bool = False
    missing_ok: bool = False


class Needs(NamedTuple):
    """Names the replacements read but do not replace, looked up with the rest (a moved
    one raises PatchError before anything is set)."""

    owner: Any
    attrs: Tuple[str, ...]


Plan = Iterable[Union[Target, Needs, Tuple[Any, str, Any]]]


def _where(owner: Any, attr: Optional[str] = None, label: Any = None) -> str:
    """``module.attr``, ``module.Class.attr`` or ``path[key]`` (a registry, named by the
    dotted path it was declared with)."""
    if isinstance(label, str):
        name = label.replace(":", ".")
    elif isinstance(owner, dict):
        name = "registry"
    elif isinstance(owner, type):
        name = f"{owner.__module__}.{owner.__qualname__}"
    else:
        name = getattr(owner, "__name__", None) or repr(owner)
    if attr is None:
        return name
    return f"{name}[{attr!r}]" if isinstance(owner, dict) else f"{name}.{attr}"


# ---------------------------------------------------------------------------------------
# Patcher: replace, remember, restore
# ---------------------------------------------------------------------------------------


class Patcher:
    """Replaces attributes (and registry entries) and restores them in reverse order."""

    def __init__(self, name: str):
        self.name = name
        self._saved: List[Tuple[Any, str, Any]] = []  # (owner, attr, original as stored, or _MISSING)
        self._pairs: Dict[int, Tuple[Any, Any]] = {}  # id(replacement) -> (replacement, original)
        self._sweep: Tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self._saved)

    @staticmethod
    def resolve(owner: Any) -> Any:
        """A module, class or dict as is; a dotted path ``"pkg.mod"`` / ``"pkg.mod:Class"``
        imported (PatchError when it cannot be)."""
        if not isinstance(owner, str):
            return owner
        module_name, _, qualname = owner.partition(":")
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            raise PatchError(f"cannot import {module_name}: {e}") from e
        for part in qualname.split(".") if qualname else ():
            obj = Patcher.lookup(obj, part)
        return obj

    @staticmethod
    def lookup(owner: Any, attr: str) -> Any:
        """The object under ``owner.attr`` as stored (a class's own ``__dict__`` entry, so
        staticmethods stay staticmethods; a registry's entry), or a PatchError naming where
        it was looked for."""
        label = owner
        owner = Patcher.resolve(owner)
        if isinstance(owner, dict):
            if attr in owner:
                return owner[attr]
        elif isinstance(owner, type):
            for klass in owner.__mro__:
                if attr in vars(klass):
                    return vars(klass)[attr] if klass is owner else getattr(owner, attr)
        elif hasattr(owner, attr):
            return getattr(owner, attr)
        raise PatchError(
            f"{_where(owner, attr, label)} not found: the peer moved or renamed it (checked before patching)"
        )

    def apply(self, plan: Plan, *, sweep: Sequence[str] = ()) -> None:
        """Replace every target of ``plan``, all or nothing: every owner and attribute is
        looked up and every :class:`Build` called before the first one is set, and an error
        while setting restores what was set. ``sweep``: packages (e.g. ``("verl",)``) whose
        loaded modules also get the replacement wherever they hold a replaced object."""
        resolved = []
        for item in plan:
            if isinstance(item, Needs):
                owner = self.resolve(item.owner)
                for attr in item.attrs:
                    self.lookup(owner, attr)
                continue
            t = item if isinstance(item, Target) else Target(*item)
            try:
                owner = self.resolve(t.owner)
            except PatchError:
                if t.optional:
                    continue
                raise
            if t.missing_ok and not self._has(owner, t.attr):
                original = _MISSING
            else:
                original = self.lookup(owner, t.attr)
            resolved.append((owner, t.attr, t.new, original, _where(owner, t.attr, t.owner)))

        built: Dict[int, Tuple[Any, Any, str]] = {}  # id(Build) -> (original, replacement, where)
        changes = []
        for owner, attr, new, original, where in resolved:
            if isinstance(new, Build):
                if id(new) in built:
                    first, obj, first_where = built[id(new)]
                    if original is not first:
                        raise PatchError(f"{where} is not {first_where}: the peer changed how it names or imports it")
                else:
                    obj = new.factory(original)
                    built[id(new)] = (original, obj, where)
                new = obj
            changes.append((owner, attr, new, original))

        try:
            for owner, attr, new, original in changes:
                self._replace(owner, attr, new)
                if original is not _MISSING and original is not new and callable(original):
                    self._pairs.setdefault(id(new), (new, original))
            self._sweep = tuple(sweep)
            self._sweep_modules(to_ours=True)
        except BaseException:
            self.restore()
            raise

    def replace(self, owner: Any, attr: str, new: Any) -> Any:
        """Set ``owner.attr = new``; returns the original (looked up first, so a missing
        name raises before anything changes)."""
        owner = self.resolve(owner)
        original = self.lookup(owner, attr)
        self._replace(owner, attr, new)
        return original

    @staticmethod
    def _has(owner: Any, attr: str) -> bool:
        if isinstance(owner, dict):
            return attr in owner
        return hasattr(owner, attr)

    def _replace(self, owner: Any, attr: str, new: Any) -> None:
        if isinstance(owner, dict):
            own = owner.get(attr, _MISSING)
        elif isinstance(owner, type):
            own = vars(owner).get(attr, _MISSING)
        else:
            own = getattr(owner, attr, _MISSING)
        if isinstance(owner, dict):
            owner[attr] = new
        else:
            setattr(owner, attr, new)
        self._saved.append((owner, attr, own))  # only once set: a failed set has nothing to undo

    def restore(self) -> None:
        """Put back every original, last replaced first (and, with a sweep, in every loaded
        module of the swept packages, those imported while patched included); an attribute
        or registry key that was absent is removed again."""
        self._sweep_modules(to_ours=False)
        while self._saved:
            owner, attr, original = self._saved.pop()
            if isinstance(owner, dict):
                if original is _MISSING:
                    owner.pop(attr, None)
                else:
                    owner[attr] = original
            elif original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._pairs.clear()
        self._sweep = ()

    def _sweep_modules(self, *, to_ours: bool) -> None:
        """Every loaded module of the swept packages whose attribute is a replaced original
        (``to_ours``) or one of the replacements (restoring) gets the other; replacements
        go through the patcher (restored with the rest), restorations are direct."""
        if not self._sweep or not self._pairs:
            return
        pairs = {id(orig if to_ours else new): (orig, new) for new, orig in self._pairs.values()}
        for name, module in list(sys.modules.items()):
            if module is None or not any(name == p or name.startswith(p + ".") for p in self._sweep):
                continue
            for attr, value in list(vars(module).items()):
                pair = pairs.get(id(value))
                if pair is None:
                    continue
                orig, new = pair
                if to_ours and value is orig:
                    self._replace(module, attr, new)
                elif not to_ours and value is new:
                    setattr(module, attr, orig)


# ---------------------------------------------------------------------------------------
# Integration: apply() / unapply() of one peer
# ---------------------------------------------------------------------------------------


class Integration:
    """``apply()`` / ``unapply()`` of one peer: its package name, the tested version
    range ``(low, high)`` (``low <= version < high``) and the packages to sweep for
    by-name imports of replaced objects (none by default)."""

    def __init__(self, package: str, tested: Tuple[str, str], *, sweep: Sequence[str] = ()):
        self.package = package
        self.tested = tested
        self.sweep = tuple(sweep)
        self._lock = threading.RLock()
        self._patcher: Optional[Patcher] = None
        self._options: Optional[Dict[str, Any]] = None

    def apply(
        self,
        plan: Callable[[], Plan],
        *,
        strict: bool,
        count_calls: Optional[bool] = None,
        options: Optional[Dict[str, Any]] = None,
    ) -> None:
        """Undo the previous apply(), gate on the version, then patch ``plan()``'s targets
        all or nothing (see the module docstring). ``count_calls``: True/False turns call
        counting on/off once applied (None leaves it). ``options``: what
        :meth:`applied_options` returns."""
        with self._lock:
            self._unapply_locked()
            try:
                peer = importlib.import_module(self.package)
            except ImportError as e:
                raise PatchError(f"integrations.{self.package}.apply(): {self.package} is not installed ({e})") from e
            # stacklevel: warn -> check_version -> Integration.apply -> <peer>.apply -> caller
            check_version(
                self.package, _installed_version(peer, self.package), *self.tested, strict=strict, stacklevel=4
            )
            patcher = Patcher(self.package)
            patcher.apply(plan(), sweep=self.sweep)
            if count_calls is not None:
                set_counting(count_calls)
            self._patcher, self._options = patcher, dict(options or {})

    def unapply(self) -> bool:
        """Restore every object apply() replaced (the identical originals). False when
        nothing was applied."""
        with self._lock:
            return self._unapply_locked()

    def _unapply_locked(self) -> bool:
        if self._patcher is None:
            return False
        self._patcher.restore()
        self._patcher, self._options = None, None
        return True

    def is_applied(self) -> bool:
        return self._patcher is not None

    def applied_options(self) -> Optional[Dict[str, Any]]:
        return None if self._options is None else dict(self._options)
