// bf16 matrix products on a packed weight (gemm_bf16.cpp), registered into fastdecode._spart_ops.
#pragma once

#include <torch/extension.h>

void register_gemm_bf16(pybind11::module_& m);
