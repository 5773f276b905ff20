"""The engine with the remote backend bit-for-bit equal to the in-process local backend
(same tokens) under continuous batching (fewer slots than requests), with one
mini-batch and with head sharding. The layouts 1/2/3 workers against transformers
are in test_remote_engine_exact.py."""
from __future__ import annotations

import pytest

from fastdecode.config import EngineConfig
from fastdecode.engine import Engine, SamplingParams
from rworker.testing import local_fleet

PROMPTS = ["The quick brown fox", "Hello", "FastDecode splits the model into an S-Part",
           "def f(x):\n    return", "numbers 0123", "¿Qué tal?", "a", "jumps over the lazy dog. " * 3]


def generate(config: EngineConfig, prompts=PROMPTS, max_tokens: int = 10) -> dict[str, list[int]]:
    engine = Engine(config)
    try:
        params = SamplingParams.from_dict({"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
        ids = [engine.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        assert reasons == {i: "length" for i in ids}, reasons
        return tokens
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with local_fleet(3, tmp_path_factory.mktemp("fleet"), kv_capacity="16M") as f:
        yield f


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    # max_running below the number of prompts: sequences join and leave mid-run.
    return generate(EngineConfig(model=tiny_model_dir, attention="local", max_running=5, kernel_threads=1))


@pytest.mark.parametrize("workers,shards,minibatches", [(3, 1, 1), (2, 2, 2)],
                         ids=["3w-one-minibatch", "2w-head-shards"])
def test_remote_is_token_exact_with_local(fleet, tiny_model_dir, expected, workers, shards, minibatches):
    config = EngineConfig(model=tiny_model_dir, attention="remote", rworkers=fleet.addresses[:workers],
                          head_shards=shards, num_minibatches=minibatches, max_running=5)
    assert generate(config) == expected
