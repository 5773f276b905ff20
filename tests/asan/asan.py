"""`make test-asan`: the C++ kernel (csrc/*.cpp -> rpart._kernels) built with AddressSanitizer and
UBSan into build/asan/ (rpart/_kernels*.so, which running processes may have mapped, is never
touched), then pytest on the kernel and KV-store tests against that build.

    python tests/asan/asan.py build          # incremental: objects rebuilt when a source or header changed
    python tests/asan/asan.py test [pytest args]

The sanitizer runtimes of the compiler that built the module are preloaded (Python itself is not
instrumented). ASAN_OPTIONS has detect_leaks=0: the interpreter keeps objects alive until exit, and
the leak report would be about them, not about the kernel. Any ASan or UBSan report aborts the
process (halt_on_error, -fno-sanitize-recover), so the run fails.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "asan"
KERNEL_DIR = OUT / "rpart"
SITE = Path(__file__).resolve().parent / "site"
REPORTS = OUT / "reports"                    # <asan|ubsan>.<pid>, one per process that hit an error
CXX = os.environ.get("CXX", "g++")
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-O1", "-g"]
# What setup.py gives the kernel, less -O3 (see csrc/ and setup.py).
FLAGS = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-fno-math-errno", "-Wall"]
TESTS = ["tests/test_kernel.py", "tests/test_kernel_int4.py", "tests/test_kernel_threads.py", "tests/test_kernel_errors.py",
         "tests/test_kernel_groups.py", "tests/test_fuzz_kvstore.py",
         "tests/test_fuzz_rworker.py", "tests/test_fuzz_rworker_shapes.py", "tests/test_fuzz_rworker_wire.py",
         "tests/test_rworker_server.py"]


def module_path() -> Path:
    return KERNEL_DIR / ("_kernels" + sysconfig.get_config_var("EXT_SUFFIX"))


def runtime(name: str) -> str:
    path = subprocess.check_output([CXX, f"-print-file-name={name}"], text=True).strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        sys.exit(f"{CXX} has no {name} (got {path!r}): install the compiler's sanitizer runtimes")
    return path


def build() -> Path:
    import pybind11

    sources = sorted(glob.glob(str(ROOT / "csrc" / "*.cpp")))
    headers = glob.glob(str(ROOT / "csrc" / "*.h"))
    includes = [f"-I{ROOT / 'csrc'}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    (OUT / "obj").mkdir(parents=True, exist_ok=True)
    KERNEL_DIR.mkdir(parents=True, exist_ok=True)
    newest_header = max(os.path.getmtime(h) for h in headers)

    def compile_one(src: str) -> str:
        obj = OUT / "obj" / (Path(src).stem + ".o")
        if not obj.exists() or obj.stat().st_mtime < max(os.path.getmtime(src), newest_header):
            tmp = obj.with_suffix(".o.tmp")
            cmd = [CXX, *FLAGS, *SANITIZE, *includes, "-c", src, "-o", str(tmp)]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            tmp.replace(obj)
        return str(obj)

    # all at once: the attention files take minutes each under the sanitizers
    with ThreadPoolExecutor(max_workers=len(sources)) as pool:
        objects = list(pool.map(compile_one, sources))
    target = module_path()
    if not target.exists() or target.stat().st_mtime < max(os.path.getmtime(o) for o in objects):
        tmp = target.with_suffix(".tmp")
        subprocess.run([CXX, "-shared", *SANITIZE, "-fopenmp", "-pthread", *objects, "-o", str(tmp)], check=True)
        tmp.replace(target)       # a new inode: a process that mapped the old one keeps it intact
    print(f"ASan kernel: {target}")
    return target


def environment() -> dict:
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join([runtime("libasan.so"), runtime("libubsan.so"), env.get("LD_PRELOAD", "")]).strip()
    # reports go to files: pytest captures stderr, and a process the sanitizer stops loses what it captured
    env["ASAN_OPTIONS"] = f"detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path={REPORTS / 'asan'}"
    env["UBSAN_OPTIONS"] = f"halt_on_error=1:print_stacktrace=1:log_path={REPORTS / 'ubsan'}"
    env["FASTDECODE_ASAN_KERNEL_DIR"] = str(KERNEL_DIR)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(SITE), env.get("PYTHONPATH", "")] if p)
    return env


CHECK = """
import rpart._kernels as k, sys
maps = open('/proc/self/maps').read()
assert k.__file__ == sys.argv[1], ('the kernel came from', k.__file__)
assert 'libasan' in maps and 'libubsan' in maps, 'sanitizer runtimes not loaded'
print('kernel under ASan+UBSan:', k.__file__)
"""


def test(pytest_args: list[str]) -> int:
    if not module_path().exists():
        sys.exit(f"no ASan build at {module_path()}: run `python tests/asan/asan.py build` first")
    env = environment()
    subprocess.run([sys.executable, "-c", CHECK, str(module_path())], env=env, cwd=ROOT, check=True)
    named = any(a.startswith("tests") for a in pytest_args)     # else the default set, with these options
    # --capture=sys: with pytest's default fd capture, the run under the sanitizers ended after its first
    # test with status 1 and no report, no sanitizer log written (cause not found); sys capture runs it all
    capture = [] if any(a.startswith("--capture") or a == "-s" for a in pytest_args) else ["--capture=sys"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *capture, *pytest_args,
           *([] if named else TESTS)]
    print(" ".join(cmd), flush=True)
    shutil.rmtree(REPORTS, ignore_errors=True)
    REPORTS.mkdir(parents=True)
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    reports = sorted(REPORTS.iterdir())
    for r in reports:
        print(f"==== {r}\n{r.read_text(errors='replace')}")
    return rc or (1 if reports else 0)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("build", "test"):
        sys.exit(__doc__)
    if argv[0] == "build":
        build()
        return 0
    return test(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
