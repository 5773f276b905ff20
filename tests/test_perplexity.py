"""int4 KV keeps the default model's perplexity within 10% of fp16 KV (and the
torch reference, fp32 KV, sanity-checks the fp16 number)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastdecode.config import DEFAULT_MODEL_DIR, EngineConfig

TEXT = Path(__file__).parent / "data" / "alice_ch1.txt"
RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "perplexity.json"


def test_int4_perplexity_within_10_percent_of_fp16():
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("default model not converted; run `make model`")
    kernels = pytest.importorskip("fastdecode.kernels", reason="the kernel module is not available")
    if "int4" not in getattr(kernels, "KV_FORMATS", ()):
        pytest.skip("the kernel has no int4 KV format yet")
    from fastdecode.eval import perplexity
    from fastdecode.model.loader import load_model

    text = TEXT.read_text(encoding="utf-8")
    base = EngineConfig(model=str(DEFAULT_MODEL_DIR), attention="local")
    loaded = load_model(base.model)
    ppl = {fmt: perplexity(base.replace(kv_format=fmt), text, loaded=loaded) for fmt in ("fp16", "int4")}
    ref = perplexity(base.replace(attention="torch"), text, loaded=loaded)
    fp16, int4 = ppl["fp16"]["perplexity"], ppl["int4"]["perplexity"]
    print(f"\nperplexity on {TEXT.name} ({ppl['fp16']['tokens_scored']} tokens scored): "
          f"fp32 KV (torch) {ref['perplexity']:.4f}, fp16 KV {fp16:.4f}, int4 KV {int4:.4f} "
          f"({100 * (int4 / fp16 - 1):+.2f}%)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"text": TEXT.name, "model": DEFAULT_MODEL_DIR.name, "fp32_kv_torch": ref,
                                   "fp16_kv": ppl["fp16"], "int4_kv": ppl["int4"],
                                   "int4_over_fp16": int4 / fp16}, indent=2) + "\n")
    assert abs(fp16 / ref["perplexity"] - 1) < 0.01           # fp16 storage barely moves it
    assert int4 <= 1.10 * fp16
    assert 1.0 < fp16 < 100.0                                   # a working model on plain English
