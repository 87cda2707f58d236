"""The kernel contracts and the dispatch table agree with what the kernels implement.

- Each parameter dataclass of ``rlvr_kernels.contracts`` lists the same fields, in the same
  order, as the X-macro lists of its C++ header (``csrc/<op>.h``), and each branch-code enum
  has the same names and values on both sides.
- ``pack``/``unpack`` round-trip, and lists of the wrong length are refused on both sides.
- Every row of the dispatch table resolves to a callable, named after its kernel.
"""

from __future__ import annotations

import enum
import pathlib
import re

import pytest
import torch

import rlvr_kernels.contracts as contracts
from rlvr_kernels._core import dispatch as _dispatch
from rlvr_kernels._core import layout
from rlvr_kernels.contracts import KernelParams

CSRC = pathlib.Path(__file__).resolve().parents[2] / "rlvr_kernels" / "csrc"


def _headers() -> str:
    return "\n".join(p.read_text() for p in sorted(CSRC.glob("*.h")))


def _macro_list(text: str, macro: str):
    """The entries of ``#define MACRO(X) X(a) X(b, 1) ...`` (continuation lines joined)."""
    flat = text.replace("\\\n", " ")
    m = re.search(rf"^[ \t]*#define\s+{macro}\(X\)(.*)", flat, re.M)  # (not the examples in comments)
    assert m, f"csrc/*.h defines no {macro}(X) list"
    return [tuple(a.strip() for a in args.split(",")) for args in re.findall(r"X\(([^()]*)\)", m.group(1))]


def _param_classes():
    seen, todo = [], list(KernelParams.__subclasses__())
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo += cls.__subclasses__()
    return sorted((c for c in seen if c.CPP_NAME), key=lambda c: c.__name__)


def _code_enums():
    return sorted(getattr(contracts, "CPP_CODES", {}).items())


def test_every_op_has_a_contract():
    names = {c.CPP_NAME for c in _param_classes()}
    ops = {"POLICY_LOSS", "GROUP_ADVANTAGES", "LINEAR_LOGPROBS_BWD", "LOGPROBS_STATS", "ROLLOUT_MISMATCH"}
    assert ops <= names, names


@pytest.mark.parametrize("cls", _param_classes(), ids=lambda c: c.__name__)
def test_packed_fields_are_the_dataclass_fields(cls):
    """The lists computed at class creation (before the dataclass decorator ran) are the
    dataclass's own fields, split by kind in declaration order."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(cls)]
    floats, ints = cls.float_fields(), cls.int_fields()
    assert sorted(floats + ints) == sorted(names)
    assert [n for n in names if n in floats] == list(floats)
    assert [n for n in names if n in ints] == list(ints)


def test_pack_traces_under_torch_compile():
    """pack() is called inside compiled regions (the ops build their params there)."""
    cls = contracts.GroupAdvantagesParams
    params = cls.unpack([0.25] * len(cls.float_fields()), [1] * len(cls.int_fields()))

    def f(x):
        fparams, iparams = params.pack()
        return x * fparams[0] + iparams[0]

    x = torch.ones(3)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), f(x))


@pytest.mark.parametrize("cls", _param_classes(), ids=lambda c: c.__name__)
def test_params_match_cpp_header(cls):
    text = _headers()
    floats = [e[0] for e in _macro_list(text, f"RLVR_{cls.CPP_NAME}_FPARAMS")]
    ints = [e[0] for e in _macro_list(text, f"RLVR_{cls.CPP_NAME}_IPARAMS")]
    assert floats == list(cls.float_fields())
    assert ints == list(cls.int_fields())


@pytest.mark.parametrize("macro, enum_cls", _code_enums(), ids=lambda v: v if isinstance(v, str) else "")
def test_codes_match_cpp_header(macro, enum_cls):
    assert issubclass(enum_cls, enum.IntEnum)
    cpp = [(name, int(value)) for name, value in _macro_list(_headers(), macro)]
    assert cpp == [(m.name, m.value) for m in enum_cls]


@pytest.mark.parametrize("cls", _param_classes(), ids=lambda c: c.__name__)
def test_pack_unpack_round_trip(cls):
    floats, ints = cls.float_fields(), cls.int_fields()
    fparams = [0.5 + i for i in range(len(floats))]
    iparams = [0] * len(ints)
    params = cls.unpack(fparams, iparams)
    assert params.pack() == (fparams, iparams)
    with pytest.raises(ValueError, match=f"{cls.__name__}: expected {len(floats)} fparams"):
        cls.unpack(fparams + [1.0], iparams)
    with pytest.raises(ValueError, match="iparams"):
        cls.unpack(fparams, iparams[:-1] if iparams else [0])  # (a contract may have no int field)


def test_dispatch_rows_resolve():
    for (op, backend), provider in _dispatch.KERNELS.items():
        assert backend in _dispatch.BACKENDS, (op, backend)
        if backend == "triton" and not _dispatch.triton_available():
            pytest.fail("triton is not installed")
        fn = _dispatch.kernel(op, backend)
        assert callable(fn), provider
        # The C++ op and the Triton launcher are named after the kernel they run.
        assert provider.rsplit(":", 1)[1] == op, provider


def test_dispatch_refuses_what_it_lacks():
    with pytest.raises(NotImplementedError, match="has no 'cuda' kernel"):
        _dispatch.kernel("policy_loss_fwd", "cuda")
    with pytest.raises(ValueError, match="backend: expected one of"):
        _dispatch.check_backend("gpu")
    assert _dispatch.available_backends("cpu")[0] == "reference"


def test_sanitized_offsets():
    cu = torch.tensor([3, 1, 9, 4, 100, -5])
    assert layout.sanitized_offsets(cu, 10).tolist() == [3, 3, 9, 9, 10, 10]
    good = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    assert torch.equal(layout.sanitized_offsets(good, 7), good.long())
