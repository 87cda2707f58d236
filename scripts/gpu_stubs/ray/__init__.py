"""Import-only stand-in for `ray` on the lent GPU machine.

verl imports ray at module level (verl.protocol) but the functions our benchmarks and
peer tests call never use it, and ray's wheel is too large to carry there. Used only by
scripts/gpu_check.sh, never installed.
"""


class _Anything:
    def __getattr__(self, name):
        return _Anything()

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(name):
    return _Anything()
