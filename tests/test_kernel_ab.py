"""bench/kernel_ab.py: kernel builds side by side in one process, and its refusals."""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("kernel_ab", os.path.join(ROOT, "bench", "kernel_ab.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compares_two_builds(ab, tmp_path):
    build = glob.glob(os.path.join(ROOT, "rpart", "_kernels*.so"))[0]
    copy = str(tmp_path / "copy.so")
    shutil.copy(build, copy)
    args = ab.parse([build, copy, "--batch", "2", "--ctx", "40", "--threads", "1", "--rounds", "3",
                     "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--groups", "-", "32/32"])
    rows = ab.run(args)
    assert [r["build"] for r in rows] == [build, copy]
    assert [r["groups"] for r in rows] == [None, (32, 32)]
    first, second = ab.load_build(build), ab.load_build(copy)  # two libraries, not one twice
    assert first is not second and first.KVStore is not second.KVStore
    assert os.path.realpath(second.__file__) == os.path.realpath(copy)
    assert ab.load_build(copy) is second
    assert rows[0]["over_first"] == 1.0
    for r in rows:
        assert r["s"] > 0 and r["GBps"] > 0 and r["stream_GBps"] > 0 and r["over_first"] > 0


def test_refuses_garbage(ab, tmp_path):
    with pytest.raises(ValueError, match="no kernel build"):
        ab.load_build(str(tmp_path / "missing.so"))
    junk = tmp_path / "junk.so"
    junk.write_text("not an ELF file")
    with pytest.raises(ValueError, match="not a loadable kernel build"):
        ab.load_build(str(junk))
    for argv in (["a.so", "--batch", "0"], ["a.so", "--ctx", "-3"], ["a.so", "--rounds", "x"],
                 ["a.so", "--fmt", "int8"], ["a.so", "--heads", "9", "--kv-heads", "2"], [],
                 ["a.so", "--groups", "32"], ["a.so", "--groups", "a/b"], ["a.so", "b.so", "--groups", "32/32"],
                 ["a.so", "--fmt", "fp16", "--groups", "32/32"]):
        with pytest.raises(SystemExit):
            ab.parse(argv)
