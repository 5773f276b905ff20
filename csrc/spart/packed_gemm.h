// fp32 linear layers on MKL-packed weights (packed_gemm.cpp), registered into fastdecode._spart_ops.
#pragma once

#include <torch/extension.h>

void register_packed_gemm(pybind11::module_& m);
