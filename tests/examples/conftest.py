"""Shared by the example tests: ``examples/grpo_tiny.py`` imported once, and one warm-up
cache for the session (the supervised warm-up is the slow part of a short run)."""

import importlib.util
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def load_example(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def ex():
    return load_example("grpo_tiny")


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("warmup"))


@pytest.fixture(scope="session")
def dvg(ex):  # ``ex`` first: the script imports the same grpo_tiny module
    return load_example("dynamics_vs_grpo")


@pytest.fixture(scope="session")
def ra():
    return load_example("rollout_alignment")
