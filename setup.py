"""Builds the R-Part kernel (csrc/ -> fastdecode._kernels) and the R-worker gRPC stubs."""
import glob
import os
import subprocess
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_protos() -> None:
    protos = glob.glob(os.path.join(HERE, "rworker", "proto", "*.proto"))
    if not protos:
        return
    subprocess.check_call([sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}",
                           f"--python_out={HERE}", f"--grpc_python_out={HERE}", f"--pyi_out={HERE}",
                           *[os.path.relpath(p, HERE) for p in protos]], cwd=HERE)


class BuildAll(build_ext):
    def run(self):
        generate_protos()
        super().run()


kernels = Pybind11Extension(
    "fastdecode._kernels",
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

setup(ext_modules=[kernels] if glob.glob("csrc/*.cpp") else [], cmdclass={"build_ext": BuildAll})
