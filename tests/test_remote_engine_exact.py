"""The engine's token-exact suite (tests/test_engine_exact.py) with the remote backend,
against 1, 2 and 3 real R-worker processes, and with a sequence's KV heads split
over 2 and 3 workers (head sharding)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import test_engine_exact
from test_engine_exact import EngineExactSuite, default_model_dir
from test_rworker_server import stats

from fastdecode.ops.testing import local_fleet

# The default-suite run of the default model: 3 of the suite's prompts (prose, code, three
# scripts), 8 new tokens each.
SHORT_PROMPTS = (1, 3, 5)
SHORT_NEW_TOKENS = 8

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

    def test_default_model_fp32_short_token_exact_on_2_workers(self, rworker_addresses, monkeypatch):
        """The real model through 2 R-workers in the default suite: the slow test below cut to
        SHORT_PROMPTS and SHORT_NEW_TOKENS (with a reference cache of its own, so the shared one
        never holds the cut prompt list); both workers must have served calls."""
        model_dir = default_model_dir()
        workers = rworker_addresses[:2]
        calls = [stats(a).calls for a in workers]
        monkeypatch.setattr(test_engine_exact, "PROMPTS", [test_engine_exact.PROMPTS[i] for i in SHORT_PROMPTS])
        monkeypatch.setattr(test_engine_exact, "NEW_TOKENS", SHORT_NEW_TOKENS)
        monkeypatch.setattr(test_engine_exact, "hf_reference",
                            functools.lru_cache(maxsize=None)(test_engine_exact.hf_reference.__wrapped__))
        self._check(model_dir, {"attention": "remote", "rworkers": tuple(workers), "head_shards": 1})
        assert all(stats(a).calls > n for a, n in zip(workers, calls)), (calls, [stats(a).calls for a in workers])

    @pytest.mark.slow
    def test_default_model_fp32_token_exact(self, backend_overrides):
        super().test_default_model_fp32_token_exact(backend_overrides)

    # The default run covers every layout on one tiny model with 3 kv heads (sharded 2 + 1 and
    # 1 + 1 + 1); the other models run with -m slow.
    @pytest.mark.parametrize("name", ["kv3", *(pytest.param(n, marks=pytest.mark.slow)
                                              for n in ("gqa", "mha_tied", "llama3_rope", "qwen2_bias"))])
    def test_tiny_models_token_exact(self, tiny_model_dirs, name, backend_overrides):
        self._check(tiny_model_dirs[name], backend_overrides)
