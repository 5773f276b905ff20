// bf16 matrix-vector products (gemv_bf16.cpp), registered into fastdecode._spart_ops.
#pragma once

#include <torch/extension.h>

void register_gemv_bf16(pybind11::module_& m);
