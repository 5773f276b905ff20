"""The engine's token-exact suite (tests/test_engine_exact.py) with the remote backend,
against 1, 2 and 3 real R-worker processes, and with a sequence's KV heads split
over 2 and 3 workers (head sharding)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_engine_exact import EngineExactSuite

from rworker.testing import local_fleet

LAYOUTS = [  # (workers, head_shards)
    pytest.param((1, 1), id="1w"),
    pytest.param((2, 1), id="2w"),
    pytest.param((3, 1), id="3w"),
    pytest.param((2, 2), id="2w-head-shards"),
    pytest.param((3, 3), id="3w-head-shards3"),
]


@pytest.fixture(scope="module")
def rworker_addresses(tmp_path_factory):
    with local_fleet(3, tmp_path_factory.mktemp("rworkers"), kv_capacity="256M") as fleet:
        yield fleet.addresses


class TestRemoteEngineExact(EngineExactSuite):
    @pytest.fixture(params=LAYOUTS)
    def backend_overrides(self, request, rworker_addresses):
        workers, shards = request.param
        return {"attention": "remote", "rworkers": tuple(rworker_addresses[:workers]), "head_shards": shards}

    def _check(self, model_dir: str, overrides: dict, capsys=None) -> None:
        kv_heads = json.loads((Path(model_dir) / "config.json").read_text()).get("num_key_value_heads")
        if kv_heads is not None and overrides["head_shards"] > kv_heads:
            pytest.skip(f"{overrides['head_shards']} head shards > {kv_heads} kv heads of this model")
        super()._check(model_dir, overrides, capsys)

    @pytest.mark.slow
    def test_default_model_fp32_token_exact(self, backend_overrides):
        super().test_default_model_fp32_token_exact(backend_overrides)

    # The default run covers every layout on one tiny model with 3 kv heads (sharded 2 + 1 and
    # 1 + 1 + 1); the other models run with -m slow.
    @pytest.mark.parametrize("name", ["kv3", *(pytest.param(n, marks=pytest.mark.slow)
                                              for n in ("gqa", "mha_tied", "llama3_rope", "qwen2_bias"))])
    def test_tiny_models_token_exact(self, tiny_model_dirs, name, backend_overrides):
        self._check(tiny_model_dirs[name], backend_overrides)
