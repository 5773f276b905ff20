"""The packages' boundaries: the R-Part core (rpart) and the R-worker import no torch, no
transformers and nothing of the S-worker; no two packages import each other."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from fastdecode.config import REPO_ROOT

PACKAGES = ("fastdecode", "rpart", "rworker", "python_backend", "openai_frontend")
# what each package may import of the others (and of torch / transformers)
ALLOWED = {
    "rpart": set(),
    "rworker": {"rpart"},
    "fastdecode": {"rpart", "torch", "transformers"},
    "python_backend": {"fastdecode", "rpart", "torch", "transformers"},
    "openai_frontend": {"fastdecode", "transformers"},
}
WATCHED = set(PACKAGES) | {"torch", "transformers"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots & WATCHED


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    wrong = {}
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        bad = imported_roots(path) - ALLOWED[package] - {package}
        if bad:
            wrong[str(path.relative_to(REPO_ROOT))] = sorted(bad)
    assert not wrong, f"{package} imports what it must not: {wrong}"


def test_an_rworker_host_needs_no_torch(tmp_path):
    """The R-worker starts, stores KV and attends with torch and transformers unimportable."""
    code = """
import sys
sys.modules["torch"] = None
sys.modules["transformers"] = None
import numpy as np
from rworker.service import default_store_factory
import rworker.server, rworker.__main__, rpart.wire, rpart.auth, rpart.errors
store = default_store_factory(num_layers=1, num_kv_heads=1, head_dim=32, capacity_bytes=1 << 20)
store.create([1])
k = np.ones((4, 1, 32), np.float32)
store.append_span(0, [1], [4], k, k)
o = store.decode(0, [1], np.ones((1, 1, 32), np.float32), np.ones((1, 1, 32), np.float32),
                 np.ones((1, 1, 32), np.float32))
assert o.shape == (1, 1, 32) and np.allclose(o, 1.0), o
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "torch" not in run.stderr
