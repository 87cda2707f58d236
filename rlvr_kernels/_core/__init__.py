"""The ground floor of the package: what every layer may import, and which imports nothing
of the package above it.

- :mod:`.validation`: the input checks (each error names the argument);
- :mod:`.dispatch`: the dispatch table (which function runs each kernel on each backend);
- :mod:`.cache`: the CPU output-buffer cache of the C++ kernels;
- :mod:`.layout`: the packed-layout rules (sanitised offsets, packed masks, local counts)
  and the compute-dtype and division helpers;
- :mod:`.collectives`: the one cross-rank handshake and the collectives of every
  ``process_group=`` path;
- :mod:`.platform`: what machine this is;
- :mod:`.extension`: compiling and loading the C++ kernels against the torch in use.
"""
