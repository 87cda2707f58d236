// The Python side of packing: what takes Python objects (per-sample lists, numpy arrays, tensors,
// rollout dicts), which an op schema cannot. Bound into the extension's Python module (ops.cpp).
#pragma once

#include <torch/extension.h>

namespace rlvr {

void bind_packing(pybind11::module_& m);

}  // namespace rlvr
