"""Shared fixtures. Tiny models are built once per session (random init, no download).

The C++ extensions are required: when rpart._kernels or fastdecode._spart_ops does not
import, the session fails at its start (no test is skipped or switched to another backend)."""
from __future__ import annotations

import importlib

import pytest

from fastdecode.testing import make_tiny_llama

REQUIRED_EXTENSIONS = ("rpart._kernels", "fastdecode._spart_ops")


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_hog: starts a process that keeps one CPU busy for about a second; "
                                       "run it alone, never beside other tests (e.g. under pytest-xdist)")


def pytest_sessionstart(session):
    import torch  # noqa: F401  -- _spart_ops links torch's libraries, which torch loads

    missing = []
    for name in REQUIRED_EXTENSIONS:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name}: {e}")
    if missing:
        pytest.exit("the C++ extensions do not import (`make build`):\n  " + "\n  ".join(missing), returncode=1)

TINY_CONFIGS = {
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "mha_tied": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(num_heads=4, num_kv_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "qwen2_bias": dict(arch="qwen2", num_heads=4, num_kv_heads=2),
    # 3 kv heads, for head sharding at 3. Seed 1: seed 0 has a greedy top-2 gap of 3e-4, within what
    # fp16 KV moves the logits (2e-3), so the exactness suite would see a legitimate divergence.
    "kv3": dict(hidden_size=96, num_heads=6, num_kv_heads=3, seed=1),
}


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: str(make_tiny_llama(root / name, **cfg)) for name, cfg in TINY_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs) -> str:
    return tiny_model_dirs["gqa"]


@pytest.fixture
def one_torch_thread():
    """Tiny batches are latency-bound: one thread, no OpenMP spinning against other jobs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
