"""On PYTHONPATH only under tests/asan/asan.py: rpart._kernels is then imported from the
AddressSanitizer build (FASTDECODE_ASAN_KERNEL_DIR), in this process and in every Python
subprocess it starts (test R-workers included), instead of rpart/_kernels*.so."""
import os

_dir = os.environ.get("FASTDECODE_ASAN_KERNEL_DIR")
if _dir:
    import rpart

    rpart.__path__.insert(0, _dir)
