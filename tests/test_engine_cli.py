"""`python -m fastdecode generate|bench` (run in-process through fastdecode.__main__.main)."""
from __future__ import annotations

import json
import sys

import pytest

from fastdecode.__main__ import main


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_generate_streams_text(tiny_model_dir, capsys, monkeypatch):
    from fastdecode.config import EngineConfig
    from fastdecode.engine import Engine, SamplingParams

    engine = Engine(EngineConfig(model=tiny_model_dir, attention="torch"))
    try:
        outs = list(engine.generate("The quick brown fox", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    finally:
        engine.stop()
    expected = "".join(o.text for o in outs)
    assert expected.strip() and sum(bool(o.text) for o in outs) >= 2       # the greedy reply: several pieces
    capsys.readouterr()

    writes: list[str] = []
    real_write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: (writes.append(s), real_write(s))[1])
    rc = main(["generate", "--model", tiny_model_dir, "--attention", "torch", "--max-tokens", "6",
               "--ignore-eos", "The quick brown fox"])
    out = capsys.readouterr()
    assert rc == 0
    assert "[length: " in out.err and "6 generated tokens" in out.err
    assert out.out == expected + "\n"                                  # the model's text, then a newline
    assert [w for w in writes if w] == [o.text for o in outs if o.text] + ["\n"]   # streamed piece by piece


def test_generate_sampling_flags_and_bad_values(tiny_model_dir, capsys):
    rc = main(["generate", "--model", tiny_model_dir, "--attention", "torch", "--max-tokens", "4", "--temperature",
               "0.8", "--top-p", "0.9", "--top-k", "5", "--seed", "1", "--stop", "zz", "hello"])
    assert rc == 0
    rc = main(["generate", "--model", tiny_model_dir, "--attention", "torch", "--top-p", "1.5", "hello"])
    assert rc == 2 and "top_p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", tiny_model_dir, "--dtype", "int3", "hello"])


def test_bench_prints_json(tiny_model_dir, capsys):
    rc = main(["bench", "--model", tiny_model_dir, "--attention", "torch", "--batch", "3", "--new-tokens", "4",
               "--prompt-len", "5", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["batch"] == 3 and result["generated_tokens"] == 12 and result["decode_tokens_per_s"] > 0
    with pytest.raises(SystemExit):
        main(["bench", "--model", tiny_model_dir, "--batch", "0"])
