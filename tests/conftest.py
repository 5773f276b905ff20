"""Shared fixtures. Tiny models are built once per session (random init, no download)."""
from __future__ import annotations

import pytest

from fastdecode.testing import make_tiny_llama

TINY_CONFIGS = {
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "mha_tied": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(num_heads=4, num_kv_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "qwen2_bias": dict(arch="qwen2", num_heads=4, num_kv_heads=2),
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
