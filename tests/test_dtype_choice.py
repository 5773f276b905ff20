"""dtype="auto": configured dtypes pass through, a CPU without native bf16 takes fp32 without a
probe, and one with it takes whichever the probe timed faster."""
from __future__ import annotations

import itertools
import time

import pytest
import torch

from fastdecode.config import EngineConfig
from fastdecode.model import dtype_choice
from fastdecode.model.dtype_choice import DtypeChoice, choose_dtype, probe, probe_shapes
from fastdecode.model.llama import ModelArgs
from fastdecode.model.loader import load_model

ARGS = ModelArgs(vocab_size=1000, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=128,
                 tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False)


def fake_timer(times: dict[str, list[float]]):
    """time_products stand-in: each dtype's runs return its times in turn."""
    def make(shapes, dtype, batch):
        it = itertools.cycle(times[str(dtype).removeprefix("torch.")])
        return lambda: next(it)
    return make


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_configured_dtype_is_taken_as_given(monkeypatch, dtype):
    monkeypatch.setattr(dtype_choice, "time_products", lambda *a: pytest.fail("probed a configured dtype"))
    assert choose_dtype(dtype, "cpu", ARGS, 256, flags=["avx512_bf16"]) == DtypeChoice(dtype, "configured")


def test_no_native_bf16_means_fp32_without_a_probe(monkeypatch):
    monkeypatch.setattr(dtype_choice, "time_products", lambda *a: pytest.fail("probed without native bf16"))
    choice = choose_dtype("auto", "cpu", ARGS, 256, flags=["avx2", "avx512f", "f16c"])
    assert choice.dtype == "float32" and not choice.seconds


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="torch's oneDNN has no bf16 here")
@pytest.mark.parametrize("bf16, fp32, want", [([0.2, 0.1], [0.3, 0.3], "bfloat16"),
                                              ([0.5, 0.4], [0.3, 0.9], "float32"),
                                              ([0.2, 0.28], [0.3, 0.22], "float32"),   # bf16 1.1x: not enough
                                              ([0.2, 0.3], [0.23, 0.4], "bfloat16")])  # 1.15x
def test_native_bf16_takes_the_faster_of_the_probe_by_a_margin(monkeypatch, bf16, fp32, want):
    monkeypatch.setattr(dtype_choice, "time_products", fake_timer({"bfloat16": bf16, "float32": fp32}))
    for flag in ("avx512_bf16", "amx_bf16"):
        choice = choose_dtype("auto", "cpu", ARGS, 100_000, flags=[flag])
        assert choice.dtype == want
        assert choice.seconds == {"bfloat16": min(bf16), "float32": min(fp32)}
        assert f"batch {dtype_choice.PROBE_MAX_BATCH}" in choice.reason       # capped


def test_probe_alternates_and_keeps_each_best():
    calls = []

    def run(name, times):
        it = iter(times)
        return lambda: calls.append(name) or next(it)
    best = probe({"a": run("a", [9.0, 3.0, 5.0, 4.0]), "b": run("b", [9.0, 6.0, 2.0, 7.0])}, rounds=3)
    assert best == {"a": 3.0, "b": 2.0}
    assert calls == ["a", "b"] + ["a", "b"] * 3          # one warm-up each, then in turn


def test_the_real_probe_times_both_and_picks_one():
    shapes = probe_shapes(ARGS)
    assert shapes[-1] == (1000, 64, 1) and all(times == ARGS.num_layers for _, _, times in shapes[:-1])
    assert all(n * k <= dtype_choice.PROBE_MAX_WEIGHT for n, k, _ in probe_shapes(
        ARGS.__class__(**{**ARGS.__dict__, "vocab_size": 200_000, "hidden_size": 4096})))
    for dtype in (torch.float32, torch.bfloat16):
        run = dtype_choice.time_products(shapes, dtype, 8)
        start = time.perf_counter()
        t = run()
        assert 0 < t < 10
        assert time.perf_counter() - start >= dtype_choice.PROBE_MIN_ROUND_S   # tiny products: repeated


def test_products_too_small_to_time_mean_fp32_without_a_probe(monkeypatch):
    """A tiny model's products take microseconds in either dtype: OpenMP wake-ups set their time and
    a probe flipped between starts (0.77 against 0.99 ms one start, 0.26 against 0.10 the next)."""
    monkeypatch.setattr(dtype_choice, "time_products", lambda *a: pytest.fail("probed products too small to time"))
    choice = choose_dtype("auto", "cpu", ARGS, 5, flags=["avx512_bf16"])
    assert choice.dtype == "float32" and "too small" in choice.reason and not choice.seconds


def test_load_model_reports_its_choice(tiny_model_dir):
    lm = load_model(tiny_model_dir, dtype="auto", batch=4)
    assert lm.dtype.dtype in ("float32", "bfloat16")
    assert all(p.dtype == getattr(torch, lm.dtype.dtype) for p in lm.model.parameters())
    assert lm.dtype.as_dict()["reason"].startswith("auto")


@pytest.mark.parametrize("bad", ["", "fp32", "int8", "AUTO", None, 32])
def test_garbage_dtypes_are_refused(tiny_model_dir, bad):
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype=bad)
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_model_dir, dtype=bad)
