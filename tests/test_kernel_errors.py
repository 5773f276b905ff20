"""The C++ KV store refuses bad input (garbage arrays, ids, lengths, layers, construction
arguments) and leaves its state untouched; without the kernel, tests fail (no silent fallback)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from rpart.kernels import KVStore, cpu_supports

from test_kernel import make_store, fill, check_against_reference


def test_garbage_input_is_rejected_and_harmless():
    rng = np.random.default_rng(10)
    store = make_store(2, 64, layers=2)
    store.create([1, 2])
    fill(store, rng, 0, [1, 2], [20, 5])
    snapshot = [store.read(i, 0) for i in (1, 2)]
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    good = store.attend(0, [1, 2], q)
    kv = rng.standard_normal((2, 2, 64)).astype(np.float32)

    def nan_at(a, idx, val=np.nan):
        a = a.copy()
        a[idx] = val
        return a

    bad_calls = [
        (KeyError, lambda: store.attend(0, [1, 77], q)),
        (KeyError, lambda: store.decode(0, [77, 1], q, kv, kv)),
        (KeyError, lambda: store.length(77)),
        (KeyError, lambda: store.read(77, 0)),
        (ValueError, lambda: store.create([2])),
        (ValueError, lambda: store.create([5, 5])),
        (ValueError, lambda: store.attend(0, [1, 1], q)),
        (ValueError, lambda: store.decode(0, [1, 1], q, kv, kv)),
        (ValueError, lambda: store.attend(0, [1, 2], q[:, :3])),        # q heads not a multiple of Hkv
        (ValueError, lambda: store.attend(0, [1, 2], q[:, :, :32])),    # head_dim
        (ValueError, lambda: store.attend(0, [1], q)),                  # batch mismatch
        (ValueError, lambda: store.attend(0, [1, 2], q[0])),            # rank
        (ValueError, lambda: store.decode(0, [1, 2], q, kv[:, :1], kv[:, :1])),  # k heads != Hkv
        (ValueError, lambda: store.decode(0, [1, 2], q, kv, kv[:, :, :63])),
        (ValueError, lambda: store.attend(0, [1, 2], q.astype(np.float64))),
        (ValueError, lambda: store.attend(0, [1, 2], q.astype(np.int32))),
        (ValueError, lambda: store.append(0, [1, 2], kv.astype(np.int8), kv)),
        (ValueError, lambda: store.attend(0, [1, 2], nan_at(q, (1, 2, 3)))),
        (ValueError, lambda: store.attend(0, [1, 2], nan_at(q, (0, 0, 0), np.inf))),
        (ValueError, lambda: store.decode(0, [1, 2], q, nan_at(kv, (1, 1, 1)), kv)),
        (ValueError, lambda: store.decode(0, [1, 2], q, kv, nan_at(kv, (0, 1, 5), -np.inf))),
        (ValueError, lambda: store.append(0, [1, 2], kv, nan_at(kv, (0, 0, 0), 1e6))),  # beyond fp16
        (ValueError, lambda: store.append(0, [1, 2], nan_at(kv, (0, 0, 0)).astype(np.float16), kv)),
        (ValueError, lambda: store.attend(2, [1, 2], q)),
        (ValueError, lambda: store.attend(-1, [1, 2], q)),
        (ValueError, lambda: store.append(5, [1, 2], kv, kv)),
        (ValueError, lambda: store.length(1, 9)),
        (ValueError, lambda: store.attend(1, [1], q[:1])),              # empty cache at layer 1
        (ValueError, lambda: store.append_span(0, [1, 2], [1], kv, kv)),
        (ValueError, lambda: store.append_span(0, [1, 2], [3, -1], kv, kv)),
        (ValueError, lambda: store.append_span(0, [1, 2], [1, 2], kv, kv)),
        (ValueError, lambda: store.append_span(0, [1, 2], [1, 1], kv, nan_at(kv, (1, 0, 0)))),
        (ValueError, lambda: store.attend(0, [[1, 2]], q)),
        (ValueError, lambda: store.attend(0, [1.5, 2], q)),
        (ValueError, lambda: store.attend(0, [1, 2], q, scale=-1.0)),
        (ValueError, lambda: store.attend(0, [1, 2], "not an array")),
    ]
    for exc, call in bad_calls:
        with pytest.raises(exc):
            call()
        for i, (kb, vb) in zip((1, 2), snapshot):
            kc, vc = store.read(i, 0)
            assert kc.shape == kb.shape and np.array_equal(kc, kb) and np.array_equal(vc, vb)
    np.testing.assert_array_equal(store.attend(0, [1, 2], q), good)
    assert store.stats()["sequences"] == 2 and store.length(1, 1) == 0


@pytest.mark.parametrize("ids", [
    [np.uint64(2**63)], np.array([2**63], dtype=np.uint64), [2**63], [2**64 + 1], [-(2**63) - 1],
    torch.tensor([2**63], dtype=torch.uint64), [True], [1, True], np.array([True]), [np.True_],
    [1.0], [1.5], np.array([1.0]), ["1"], "12", [None], [[1]], 5,
], ids=repr)
def test_garbage_ids_are_refused_not_wrapped(ids):
    """A uint64 id >= 2**63 used to wrap to a negative int64 (another sequence's id); bools,
    floats and strings must not pass as integers either."""
    store = make_store(2, 64, layers=1)
    wrapped = -(2**63)                       # what np.uint64(2**63) wraps to
    store.create([wrapped, 1])
    kv = np.zeros((1, 2, 64), np.float32)
    for call in (lambda: store.create(ids), lambda: store.free(ids),
                 lambda: store.append(0, ids, kv, kv), lambda: store.attend(0, ids, np.zeros((1, 4, 64), np.float32))):
        with pytest.raises(ValueError, match="seq_ids"):
            call()
    assert store.has(wrapped) and store.has(1) and store.stats()["sequences"] == 2 and store.length(wrapped) == 0
    with pytest.raises(ValueError, match="lens"):
        store.append_span(0, [1], [True], kv, kv)


@pytest.mark.parametrize("lens", [[1 << 62] * 3 + [(1 << 62) + 1], [(1 << 63) - 1] * 2 + [3], [1 << 31, 0, 0, 0]],
                         ids=["sum wraps to 1", "sum wraps to 1 again", "one span too long"])
def test_lengths_whose_sum_wraps_are_refused(lens):
    """int64 lengths whose sum wraps around to the rows sent passed the size and capacity checks and
    overran the pool (a segfault in the R-worker); the checks now add with overflow detection."""
    store = make_store(2, 64, layers=1)
    store.create([1, 2, 3, 4])
    kv = np.zeros((1, 2, 64), np.float32)
    before = store.stats()
    with pytest.raises(ValueError, match="lens"):
        store.append_span(0, [1, 2, 3, 4], lens, kv, kv)
    assert store.stats() == before
    store.append_span(0, [1, 2, 3, 4], [1, 0, 0, 0], kv, kv)        # the store still works
    assert store.length(1) == 1


@pytest.mark.parametrize("bad", [2**63, True, 1.0, "1", None])
def test_garbage_scalar_id_or_layer_refused(bad):
    store = make_store(2, 64, layers=2)
    store.create([1])
    for call in (lambda: store.has(bad), lambda: store.length(bad), lambda: store.read(bad, 0),
                 lambda: store.length(1, bad), lambda: store.attend(bad, [1], np.zeros((1, 4, 64), np.float32))):
        with pytest.raises(ValueError):
            call()
    assert store.has(np.int64(1)) and store.length(1, np.int32(1)) == 0 and store.has(-(2**63)) is False


def test_int64_edge_ids_are_kept_apart():
    store = make_store(2, 64, layers=1)
    edges = [(1 << 63) - 1, -(1 << 63), 0]
    store.create(np.array(edges, dtype=np.int64))
    store.append_span(0, edges, [1, 2, 3], np.ones((6, 2, 64), np.float32), np.ones((6, 2, 64), np.float32))
    assert [store.length(i) for i in edges] == [1, 2, 3]
    store.free(np.array([(1 << 63) - 1], dtype=np.uint64))   # uint64 within int64's range is fine
    assert not store.has((1 << 63) - 1) and store.has(-(1 << 63))


def test_bad_construction():
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 1 << 20, isa="sse9")
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 1 << 20, kv_format="int8")
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 100)  # less than one block
    with pytest.raises(ValueError):
        KVStore(0, 2, 64, 1 << 20)
    with pytest.raises(ValueError):
        KVStore(1, 2, 24, 1 << 20, kv_format="int4")  # int4 groups need head_dim % 16 == 0
    for isa in ("avx2", "avx512", "avx512vnni"):
        with pytest.raises(ValueError):
            KVStore(1, 2, 24, 1 << 20, isa=isa)  # vector paths need head_dim % 16 == 0
    odd = KVStore(1, 2, 24, 1 << 20, num_threads=1)  # odd head_dim: scalar path, still correct
    assert odd.isa == "scalar"
    rng = np.random.default_rng(11)
    odd.create([0])
    fill(odd, rng, 0, [0], [21])
    q = rng.standard_normal((1, 6, 24)).astype(np.float32)
    check_against_reference(odd, [0], q, odd.attend(0, [0], q))
    odd.close()
    with pytest.raises(ValueError):
        odd.attend(0, [0], q)


@pytest.mark.skipif(cpu_supports("avx512"), reason="only meaningful on a CPU without AVX-512")
def test_unsupported_isa_raises():
    with pytest.raises(ValueError):
        KVStore(1, 2, 64, 1 << 20, isa="avx512")


# ---- no silent fallback: without the kernel, tests fail

def without_kernel(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter in which rpart._kernels does not import."""
    from fastdecode.config import REPO_ROOT

    return subprocess.run([sys.executable, "-c", "import sys\nsys.modules['rpart._kernels'] = None\n" + code],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_test_rworkers_without_the_kernel_are_an_error():
    broken = without_kernel("from fastdecode.ops.testing import store_kind\nstore_kind()")
    assert broken.returncode != 0 and "ImportError" in broken.stderr and "make build" in broken.stderr, broken.stderr
    asked = without_kernel("from fastdecode.ops.testing import store_kind\nprint(store_kind('numpy'))")
    assert asked.returncode == 0 and asked.stdout.strip() == "numpy", asked.stderr


def test_the_suite_fails_without_the_kernel():
    run = without_kernel("import pytest\n"
                         "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_local_attention.py']))")
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "rpart._kernels" in run.stdout + run.stderr and "skipped" not in run.stdout, run.stdout
