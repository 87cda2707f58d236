"""How a kernel contract is written down once and read by every layer.

A kernel's scalar parameters travel through the ``torch.library`` schema as two lists,
``float[] fparams`` and ``int[] iparams``: the schema stays fixed when a parameter is added,
and the C++ and Triton kernels read them by name, not by position. Each op has one frozen
dataclass (a subclass of :class:`KernelParams`) whose fields, in declaration order, *are*
the two lists: fields annotated ``float`` go to ``fparams``, ``int`` and ``bool`` fields
to ``iparams``. Its C++ mirror is a pair of X-macro lists in the op's header
(``csrc/<op>.h``, machinery in ``csrc/params.h``), which ``tests/common/test_contracts.py``
parses and compares with the dataclass, so the two cannot drift apart.

Branch codes (loss type, KL estimator, ...) are :class:`enum.IntEnum` classes here and
``enum class`` in C++ (the same test compares them); Triton kernels take them as
``tl.constexpr`` and compare against the same enum values.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import ClassVar, List, Sequence, Tuple, TypeVar

P = TypeVar("P", bound="KernelParams")


@dataclasses.dataclass(frozen=True)
class KernelParams:
    """Base of the per-op parameter dataclasses. Subclasses add fields only."""

    # The op's name in the C++ header's X-macro lists (RLVR_<CPP_NAME>_FPARAMS / _IPARAMS).
    CPP_NAME: ClassVar[str] = ""

    # (float fields, int fields) in declaration order, set once per subclass at class
    # creation: pack() only reads class attributes, which torch.compile traces (a
    # functools.cache lookup would break the graph).
    _FIELDS: ClassVar[Tuple[Tuple[str, ...], Tuple[str, ...]]] = ((), ())

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # The dataclass decorator has not run yet, but the annotations it will read are
        # here: the fields are the non-ClassVar annotations, base classes first.
        hints = typing.get_type_hints(cls)
        floats, ints = [], []
        for name, kind in hints.items():
            if typing.get_origin(kind) is ClassVar or kind is ClassVar:
                continue
            if kind is float:
                floats.append(name)
            elif kind in (int, bool) or (isinstance(kind, type) and issubclass(kind, enum.IntEnum)):
                ints.append(name)
            else:
                raise TypeError(f"{cls.__name__}.{name}: a kernel parameter is a float, int, bool or IntEnum")
        cls._FIELDS = (tuple(floats), tuple(ints))

    @classmethod
    def float_fields(cls) -> Tuple[str, ...]:
        return cls._FIELDS[0]

    @classmethod
    def int_fields(cls) -> Tuple[str, ...]:
        return cls._FIELDS[1]

    def pack(self) -> Tuple[List[float], List[int]]:
        """``(fparams, iparams)`` in the order the schema and the C++ header expect."""
        floats, ints = self._FIELDS
        return [float(getattr(self, n)) for n in floats], [int(getattr(self, n)) for n in ints]

    @classmethod
    def unpack(cls: type[P], fparams: Sequence[float], iparams: Sequence[int]) -> P:
        """The dataclass back from the two lists, as a kernel launcher receives them; lists of
        the wrong length (a caller built for another version of the contract) are an error."""
        floats, ints = cls._FIELDS
        if len(fparams) != len(floats) or len(iparams) != len(ints):
            raise ValueError(
                f"{cls.__name__}: expected {len(floats)} fparams and {len(ints)} iparams, "
                f"got {len(fparams)} and {len(iparams)}"
            )
        hints = typing.get_type_hints(cls)
        values = dict(zip(floats, (float(v) for v in fparams)))
        for name, v in zip(ints, iparams):
            kind = hints[name]
            values[name] = bool(v) if kind is bool else kind(int(v))
        return cls(**values)
