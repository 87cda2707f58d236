"""The patching helper every integration's apply() uses (``integrations._patch``), on a
stand-in peer package: all or nothing (a failing lookup, builder or set leaves every
target untouched), unapply() restoring the identical objects, the version gate, shared
builds, optional owners, the by-name sweep and call counting."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

from rlvr_kernels.integrations import _patch
from rlvr_kernels.integrations._patch import Build, Integration, Needs, PatchError, Target

PEER = "rk_fakepeer"


def original_fn():
    return "peer"


def other_fn():
    return "other"


class Base:
    def inherited(self):
        return "base"


@pytest.fixture
def peer():
    """A stand-in peer: a package with a version, a module with functions, a class and a
    registry dict, and a second module that imported ``original_fn`` by name."""

    class Trainer(Base):
        @staticmethod
        def helper():
            return "static"

        def step(self):
            return "stock"

    pkg = types.ModuleType(PEER)
    pkg.__version__ = "1.2.3"
    pkg.__path__ = []
    core = types.ModuleType(f"{PEER}.core")
    core.original_fn = original_fn
    core.other_fn = other_fn
    core.Trainer = Trainer
    core.REGISTRY = {"a": original_fn}
    user = types.ModuleType(f"{PEER}.user")
    user.original_fn = original_fn  # `from .core import original_fn`
    modules = {m.__name__: m for m in (pkg, core, user)}
    sys.modules.update(modules)
    try:
        yield types.SimpleNamespace(pkg=pkg, core=core, user=user, Trainer=Trainer)
    finally:
        for name in modules:
            sys.modules.pop(name, None)
        _patch.set_counting(False)
        _patch.reset_call_counts()


def snapshot(p):
    return {
        "core.original_fn": p.core.original_fn,
        "core.other_fn": p.core.other_fn,
        "user.original_fn": p.user.original_fn,
        "Trainer.step": vars(p.Trainer)["step"],
        "Trainer.helper": vars(p.Trainer)["helper"],
        "Trainer.inherited": "inherited" in vars(p.Trainer),
        "REGISTRY": dict(p.core.REGISTRY),
    }


def assert_untouched(p, before):
    after = snapshot(p)
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value, dict):
            assert after[key].keys() == value.keys(), key
            assert all(after[key][k] is v for k, v in value.items()), key
        else:
            assert after[key] is value, key


def ours():
    return "ours"


def targets(p):
    core = f"{PEER}.core"
    return [
        Target(core, "original_fn", ours),
        Target(f"{core}:Trainer", "step", Build(lambda original: lambda self: "patched " + original(self))),
        Target(p.Trainer, "helper", staticmethod(lambda: "ours")),
        Target(p.Trainer, "inherited", lambda self: "ours"),
        Target(p.core.REGISTRY, "a", ours),
        Target(p.core.REGISTRY, "new", ours, missing_ok=True),
    ]


def test_apply_then_unapply_restores_the_identical_objects(peer):
    integration = Integration(PEER, ("1.0.0", "2.0.0"))
    before = snapshot(peer)
    integration.apply(lambda: targets(peer), strict=True, options={"x": 1})
    assert integration.is_applied() and integration.applied_options() == {"x": 1}
    assert peer.core.original_fn is ours
    assert peer.Trainer().step() == "patched stock"
    assert peer.Trainer.helper() == "ours" and isinstance(vars(peer.Trainer)["helper"], staticmethod)
    assert peer.Trainer().inherited() == "ours"
    assert peer.core.REGISTRY == {"a": ours, "new": ours}
    assert integration.unapply() is True
    assert_untouched(peer, before)
    assert not integration.is_applied() and integration.applied_options() is None
    assert integration.unapply() is False


def test_apply_twice_keeps_only_the_last_and_unapply_is_stock(peer):
    integration = Integration(PEER, ("1.0.0", "2.0.0"))
    before = snapshot(peer)
    integration.apply(lambda: targets(peer), strict=True)
    integration.apply(lambda: [Target(f"{PEER}.core", "other_fn", ours)], strict=True)
    assert peer.core.original_fn is before["core.original_fn"]  # the first apply() was undone
    assert peer.core.other_fn is ours
    integration.unapply()
    assert_untouched(peer, before)


@pytest.mark.parametrize(
    "failing",
    [
        Target(f"{PEER}.core", "moved_fn", ours),  # a name the peer does not have
        Target(f"{PEER}.missing_module", "fn", ours),  # a module that does not import
        Target(f"{PEER}.core:Moved", "step", ours),  # a class that is not there
        Needs(f"{PEER}.core", ("original_fn", "moved_helper")),  # a name the replacement reads
    ],
    ids=["attribute", "module", "class", "needs"],
)
def test_a_failing_lookup_leaves_every_target_untouched(peer, failing):
    integration = Integration(PEER, ("1.0.0", "2.0.0"))
    before = snapshot(peer)
    built = []
    plan = targets(peer) + [Target(f"{PEER}.core", "other_fn", Build(lambda o: built.append(o) or ours)), failing]
    with pytest.raises(PatchError, match="moved_fn|missing_module|Moved|moved_helper"):
        integration.apply(lambda: plan, strict=True)
    assert not integration.is_applied()
    assert built == []  # every lookup comes before the first build
    assert_untouched(peer, before)


def test_a_failing_builder_leaves_every_target_untouched(peer):
    integration = Integration(PEER, ("1.0.0", "2.0.0"))
    before = snapshot(peer)

    def fail(original):
        raise RuntimeError("builder failed")

    with pytest.raises(RuntimeError, match="builder failed"):
        integration.apply(lambda: targets(peer) + [Target(f"{PEER}.core", "other_fn", Build(fail))], strict=True)
    assert not integration.is_applied()
    assert_untouched(peer, before)


def test_a_failing_plan_leaves_every_target_untouched(peer):
    integration = Integration(PEER, ("1.0.0", "2.0.0"))
    before = snapshot(peer)

    def plan():
        targets(peer)
        raise PatchError("the peer changed how it names its tree attention")

    with pytest.raises(PatchError, match="tree attention"):
        integration.apply(plan, strict=True)
    assert_untouched(peer, before)


def test_a_failing_set_restores_what_was_set(peer):
    class Frozen:
        def __setattr__(self, name, value):
            raise AttributeError("read-only")

    frozen = Frozen.__new__(Frozen)
    object.__setattr__(frozen, "fn", original_fn)
    integration = Integration(PEER, ("1.0.0", "2.0.0"))
    before = snapshot(peer)
    with pytest.raises(AttributeError, match="read-only"):
        integration.apply(lambda: targets(peer) + [Target(frozen, "fn", ours)], strict=True)
    assert not integration.is_applied()
    assert_untouched(peer, before)
    assert frozen.fn is original_fn


def test_version_gate(peer):
    integration = Integration(PEER, ("1.3.0", "2.0.0"))
    before = snapshot(peer)
    with pytest.raises(PatchError, match=r"rk_fakepeer 1\.2\.3 .*1\.3\.0 <= version < 2\.0\.0"):
        integration.apply(lambda: targets(peer), strict=True)
    assert not integration.is_applied()
    assert_untouched(peer, before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        integration.apply(lambda: targets(peer), strict=False)
    assert [str(w.message) for w in caught if "outside the range" in str(w.message)]
    assert integration.is_applied() and peer.core.original_fn is ours
    integration.unapply()
    assert_untouched(peer, before)


def test_peer_not_installed():
    with pytest.raises(PatchError, match="not installed"):
        Integration("rk_no_such_peer", ("1.0.0", "2.0.0")).apply(list, strict=True)


def test_a_shared_build_is_called_once_and_needs_the_identical_original(peer):
    calls = []
    entry = Build(lambda original: calls.append(original) or (lambda: "ours"))
    patcher = _patch.Patcher(PEER)
    patcher.apply([Target(f"{PEER}.core", "original_fn", entry), Target(peer.core.REGISTRY, "a", entry)])
    assert calls == [original_fn]
    assert peer.core.original_fn is peer.core.REGISTRY["a"]
    patcher.restore()
    assert peer.core.original_fn is original_fn and peer.core.REGISTRY["a"] is original_fn

    before = snapshot(peer)
    mismatch = Build(lambda original: ours)
    with pytest.raises(PatchError, match=r"other_fn is not rk_fakepeer\.core\.original_fn"):
        _patch.Patcher(PEER).apply(
            [Target(f"{PEER}.core", "original_fn", mismatch), Target(f"{PEER}.core", "other_fn", mismatch)]
        )
    assert_untouched(peer, before)


def test_optional_owner_is_skipped_but_a_missing_name_in_it_is_not(peer):
    patcher = _patch.Patcher(PEER)
    patcher.apply([Target(f"{PEER}.core", "original_fn", ours), Target(f"{PEER}.absent", "fn", ours, optional=True)])
    assert peer.core.original_fn is ours
    patcher.restore()
    with pytest.raises(PatchError, match="moved_fn"):
        _patch.Patcher(PEER).apply([Target(f"{PEER}.user", "moved_fn", ours, optional=True)])


def test_sweep_patches_by_name_imports_and_restores_late_ones(peer):
    integration = Integration(PEER, ("1.0.0", "2.0.0"), sweep=(PEER,))
    integration.apply(lambda: [Target(f"{PEER}.core", "original_fn", ours)], strict=True)
    assert peer.user.original_fn is ours  # found by the sweep, not declared
    late = types.ModuleType(f"{PEER}.late")
    late.original_fn = peer.core.original_fn  # imported while applied: takes ours by name
    outside = types.ModuleType("rk_not_the_peer")
    outside.original_fn = ours
    sys.modules[late.__name__] = late
    sys.modules[outside.__name__] = outside
    try:
        integration.unapply()
        assert peer.core.original_fn is original_fn and peer.user.original_fn is original_fn
        assert late.original_fn is original_fn
        assert outside.original_fn is ours  # only the swept packages
    finally:
        sys.modules.pop(late.__name__)
        sys.modules.pop(outside.__name__)


def test_count_calls(peer):
    integration = Integration(PEER, ("1.0.0", "2.0.0"))

    def counted():
        _patch.record("peer.fn")
        return "ours"

    integration.apply(lambda: [Target(f"{PEER}.core", "original_fn", counted)], strict=True, count_calls=True)
    _patch.reset_call_counts()
    peer.core.original_fn()
    peer.core.original_fn()
    assert _patch.call_counts() == {"peer.fn": 2}
    integration.apply(lambda: [Target(f"{PEER}.core", "original_fn", counted)], strict=True, count_calls=False)
    peer.core.original_fn()
    assert _patch.call_counts() == {"peer.fn": 2}
    integration.unapply()
