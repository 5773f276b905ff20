"""Builds the R-Part kernel (csrc/ -> rpart._kernels), the S-Part's fused CPU ops
(csrc/spart/ -> fastdecode._spart_ops, against torch) and the R-Part gRPC stubs (rpart/proto)."""
import glob
import os
import subprocess
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_protos() -> None:
    protos = glob.glob(os.path.join(HERE, "rpart", "proto", "*.proto"))
    if not protos:
        return
    subprocess.check_call([sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}",
                           f"--python_out={HERE}", f"--grpc_python_out={HERE}", f"--pyi_out={HERE}",
                           *[os.path.relpath(p, HERE) for p in protos]], cwd=HERE)


kernels = Pybind11Extension(
    "rpart._kernels",
    sorted(glob.glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    depends=sorted(glob.glob("csrc/*.h")),  # rebuild when a header changes, not only a .cpp
    cxx_std=17,
    # Portable baseline: ISA-specific code is compiled per function (target
    # attributes) and chosen at run time by CPU feature detection.
    # -fopenmp: a store may run on the process's OpenMP team (torch's; see thread_pool.h).
    extra_compile_args=["-O3", "-fno-math-errno", "-Wall", "-fopenmp"],
    extra_link_args=["-pthread", "-fopenmp"],
)



def spart_ops():
    """The S-Part's fused CPU ops, built against the torch in this environment. None where torch
    is absent (an R-worker host needs only the kernel) or FASTDECODE_NO_SPART_OPS=1 (an S-Part on
    a GPU never calls them); the model refuses to run on the CPU without them
    (fastdecode/model/fused.py)."""
    if os.environ.get("FASTDECODE_NO_SPART_OPS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        return None
    return CppExtension(
        "fastdecode._spart_ops", sorted(glob.glob("csrc/spart/*.cpp")), depends=sorted(glob.glob("csrc/spart/*.h")),
        # -fno-trapping-math lets the compiler vectorize the clamps of exp; nothing reads FP flags.
        extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math", "-Wall", "-fopenmp"],
        extra_link_args=["-fopenmp"])


def build_ext_class():
    """torch's build_ext where the torch extension is built (it sets torch's ABI flags), pybind11's otherwise."""
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return build_ext
    return BuildExtension


class BuildAll(build_ext_class()):
    def run(self):
        generate_protos()
        super().run()


extensions = [kernels] if glob.glob("csrc/*.cpp") else []
if glob.glob("csrc/spart/*.cpp") and spart_ops() is not None:
    extensions.append(spart_ops())
setup(ext_modules=extensions, cmdclass={"build_ext": BuildAll})
