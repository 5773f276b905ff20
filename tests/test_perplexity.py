"""int4 KV keeps the default model's perplexity within 10% of fp16 KV at a long
context (and the torch reference, fp32 KV, sanity-checks the fp16 number).

The full measurement (8 chunks of 1024 tokens, nearly all decoded) is
`python -m fastdecode.eval --compare`, which writes bench/results/perplexity.json;
this test runs a shorter version of it (2 chunks of 1024 tokens, the last 64 of
each decoded over the stored KV) and writes only to a temporary directory.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fastdecode.config import DEFAULT_MODEL_DIR

CONTEXT, CHUNKS, DECODED = 1024, 2, 32


def test_int4_perplexity_within_10_percent_of_fp16_at_long_context(tmp_path):
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("default model not converted; run `make model`")
    from fastdecode import eval as ev

    name, text = ev.default_text()
    r = ev.compare(str(DEFAULT_MODEL_DIR), text, name, context=CONTEXT, chunks=CHUNKS, prefix=CONTEXT - DECODED)
    ref, fp16, int4 = (r[k]["perplexity"] for k in ("fp32_kv_torch", "fp16_kv", "int4_kv"))
    print(f"\nperplexity on {name}, {CHUNKS} x {r['context']} tokens ({r['fp16_kv']['tokens_scored']} decoded "
          f"tokens scored): fp32 KV (torch) {ref:.4f}, fp16 KV {fp16:.4f}, int4 KV {int4:.4f} "
          f"({100 * (int4 / fp16 - 1):+.2f}%)")
    assert r["context"] == CONTEXT and r["fp16_kv"]["text_tokens"] >= CHUNKS * CONTEXT
    assert r["fp16_kv"]["tokens_scored"] == CHUNKS * DECODED            # positions 992..1023 of each chunk
    assert abs(fp16 / ref - 1) < 0.01           # fp16 storage barely moves it
    assert int4 <= 1.10 * fp16
    assert 1.0 < fp16 < 100.0                     # a working model on plain English
    assert r["int4_kv"]["int4_groups"] == [32, 64] and r["fp16_kv"]["int4_groups"] is None  # the defaults

    out = ev.write_results(r, tmp_path / "perplexity.json")
    assert json.loads(out.read_text())["int4_over_fp16"] == pytest.approx(int4 / fp16)


def test_default_text_is_long_english_prose():
    from fastdecode.eval import CHUNKS as FULL_CHUNKS, CONTEXT as FULL_CONTEXT, default_text

    name, text = default_text()
    assert "pydoc_data" in name and text.startswith("The standard type hierarchy")
    words = text.split()
    assert len(words) > FULL_CHUNKS * FULL_CONTEXT * 0.6          # ~0.75 words per token: enough for 8 x 1024
    assert sum(w.isalpha() for w in words) / len(words) > 0.6      # mostly words, not code


class SameDevice(TorchFunctionMode):
    """Refuse gather/index with tensors on two devices, as CUDA does (CPU and meta do not)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.gather, torch.Tensor.gather):
            devices = {a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)}
            if len(devices) > 1:
                raise RuntimeError(f"gather across devices {devices}")
        return func(*args, **kwargs)


def test_token_nll_follows_the_logits_device():
    """Logits live on the model's device (CUDA in production), targets are built on the CPU."""
    from fastdecode.eval import token_nll

    targets = torch.tensor([1, 4])
    with SameDevice():
        with pytest.raises(RuntimeError, match="across devices"):      # the mode does catch a mix
            torch.randn(2, 5, device="meta").gather(1, targets[:, None])
        out = token_nll(torch.randn(2, 5, device="meta"), targets)
    assert out.device.type == "meta" and out.dim() == 0
    logits = torch.randn(2, 5)
    want = -(logits.log_softmax(-1)[0, 1] + logits.log_softmax(-1)[1, 4])
    assert token_nll(logits, targets).item() == pytest.approx(want.item())
