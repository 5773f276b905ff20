"""int4 KV grouping: which groups keep the default model's perplexity closest to fp16 KV.

    make bench-int4-grouping        # -> bench/results/int4_grouping.json (about 30 minutes on 2 cores)

The kernel quantizes keys and values per token (groups of channels of one token, asymmetric, fp16
scale and zero; by default 32 channels for keys, 64 for values, `k_group` / `v_group` otherwise).
KIVI quantizes keys per channel (groups of tokens of one channel), which
follows the outlier channels of keys, and values per token. Per-channel groups need their tokens
to be complete, so the newest tokens of an unfinished group stay in fp16 until it fills (KIVI's
residual); a paged store would quantize a block once its last token arrives.

Each scheme runs as fake quantization in the plain-torch backend (stored values = dequantized
int4, same rounding as the kernel's quantize_group), through fastdecode.eval on the same text,
chunks and context as bench/results/perplexity.json. Peers in the same run: fp16 KV and int4 KV
in the real kernel at its default groups, without fp16 tails (the "k32_v64" simulation must match
it closely) and with them (the store's default: keys and values of each sequence's newest block in
fp16).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastdecode.attention.torch_ref import TorchAttention, reference_decode_attention  # noqa: E402
from fastdecode.config import EngineConfig  # noqa: E402
from fastdecode.eval import CHUNKS, CONTEXT, PREFIX, default_text, perplexity, write_results  # noqa: E402
from fastdecode.model.loader import load_model  # noqa: E402

RESULT = ROOT / "bench" / "results" / "int4_grouping.json"


def fake_int4(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric int4 over the last dim, as csrc/kv_store.cpp quantize_group: zero = min and
    scale = range / 15 rounded to fp16 (scale rounded up when it falls short of the max)."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    z = lo.half().float()
    rng = hi - z
    s = (rng / 15).half()
    short = s.float() * 15 < rng
    s = torch.where(short, torch.nextafter(s, torch.full_like(s, float("inf"))), s).float()
    u = torch.where(s > 0, ((x - z) / torch.where(s > 0, s, 1)).round(), torch.zeros_like(x)).clamp(0, 15)
    return u * s + z


def per_token(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [T, Hkv, D]: groups of `group` channels of one token."""
    t, h, d = x.shape
    return fake_int4(x.reshape(t, h, d // group, group)).reshape(t, h, d)


def per_channel(x: torch.Tensor) -> torch.Tensor:
    """x [N, Hkv, D]: one group per (kv head, channel) over the N tokens."""
    return fake_int4(x.permute(1, 2, 0)).permute(2, 0, 1)


class FakeInt4Attention(TorchAttention):
    """The torch reference with K and V stored as dequantized int4 under a grouping scheme:
      ("token", G)               G channels of a token, quantized on arrival;
      ("channel", N)             N tokens of a channel; the newest < N tokens in fp16 until
                                 their group is complete (KIVI's residual);
      ("token_tail", G, N)       per token like ("token", G), but the newest < N tokens in fp16
                                 (the residual alone, without per-channel groups);
      ("channel_requant", N, G)  the newest < N tokens per token (G channels), re-quantized per
                                 channel (N tokens) from those int4 values once complete: no fp16."""

    def __init__(self, spec, k_scheme: tuple, v_scheme: tuple) -> None:
        super().__init__(spec)
        self.schemes = {"k": k_scheme, "v": v_scheme}
        self.tail: dict[tuple[str, int, int], torch.Tensor] = {}      # (k|v, seq, layer) -> raw rows not grouped yet

    def close(self, seq_ids) -> None:
        super().close(seq_ids)
        self.tail = {key: t for key, t in self.tail.items() if key[1] not in set(seq_ids)}

    @staticmethod
    def _complete(scheme: tuple, raw: torch.Tensor) -> torch.Tensor:
        """A complete group of raw rows, as stored."""
        if scheme[0] == "channel":
            return per_channel(raw)
        if scheme[0] == "token_tail":
            return per_token(raw, scheme[1])
        return per_channel(per_token(raw, scheme[2]))          # channel_requant

    @staticmethod
    def _incomplete(scheme: tuple, raw: torch.Tensor) -> torch.Tensor:
        """Rows of a group still filling, as stored."""
        if scheme[0] == "channel_requant":
            return per_token(raw, scheme[2]) if len(raw) else raw
        return raw.half().float()

    def _store(self, which: str, s: int, layer: int, rows: torch.Tensor) -> None:
        store = self.k if which == "k" else self.v
        scheme = self.schemes[which]
        rows = rows.float()
        if scheme[0] == "token":
            store[s][layer] = torch.cat([store[s][layer], per_token(rows, scheme[1])])
            return
        n = scheme[1] if scheme[0] in ("channel", "channel_requant") else scheme[2]
        key = (which, s, layer)
        old_tail = self.tail.get(key, rows[:0])
        done = store[s][layer].shape[0] - old_tail.shape[0]
        tail = torch.cat([old_tail, rows])
        full = tail.shape[0] // n * n
        groups = [self._complete(scheme, tail[a:a + n]) for a in range(0, full, n)]
        self.tail[key] = tail[full:]
        store[s][layer] = torch.cat([store[s][layer][:done], *groups, self._incomplete(scheme, tail[full:])])

    def prefill(self, layer, seq_ids, lens, k, v) -> None:
        self._check(seq_ids)
        a = 0
        for s, n in zip(seq_ids, lens):
            self._store("k", s, layer, k[a:a + n])
            self._store("v", s, layer, v[a:a + n])
            a += n

    def submit_decode(self, layer, seq_ids, q, k, v) -> Future:
        self._check(seq_ids)
        out = torch.empty(q.shape, dtype=torch.float32)
        for i, s in enumerate(seq_ids):
            self._store("k", s, layer, k[i:i + 1])
            self._store("v", s, layer, v[i:i + 1])
            out[i] = reference_decode_attention(q[i].float(), self.k[s][layer], self.v[s][layer], self.spec.scale)
        fut: Future = Future()
        fut.set_result(out.to(q.dtype))
        return fut


SCHEMES = {   # name -> (K grouping, V grouping)
    "token32": (("token", 32), ("token", 32)),          # the kernel's format at k_group = v_group = 32
    "k32_v64": (("token", 32), ("token", 64)),          # the kernel's default format
    "kchannel16": (("channel", 16), ("token", 32)),     # KIVI, groups of one KV block (16 tokens)
    "kchannel32": (("channel", 32), ("token", 32)),     # KIVI, groups of 32 tokens
    "kvchannel16": (("channel", 16), ("channel", 16)),  # both per channel
    "token32_ktail16": (("token_tail", 32, 16), ("token", 32)),          # KIVI's fp16 residual alone
    "kchannel16_requant": (("channel_requant", 16, 32), ("token", 32)),  # per channel, no fp16 residual
    # per token with the newest block (16 tokens) of K and V in fp16, as the store's fp16 tails:
    # fewer, larger groups carry fewer scale / zero bytes (160, 152 and 144 bytes per token and
    # kv head at D=128 for 32/32, 32/64 and 64/64)
    "token32_tail16": (("token_tail", 32, 16), ("token_tail", 32, 16)),
    "k32_v64_tail16": (("token_tail", 32, 16), ("token_tail", 64, 16)),
    "k64_v32_tail16": (("token_tail", 64, 16), ("token_tail", 32, 16)),
    "token64_tail16": (("token_tail", 64, 16), ("token_tail", 64, 16)),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=EngineConfig.model)
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--chunks", type=int, default=CHUNKS)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--out", default=str(RESULT))
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    name, text = default_text()
    base = EngineConfig(model=a.model, attention="local", dtype="float32")
    loaded = load_model(base.model, base.dtype, base.torch_device, base.max_model_len)
    runs = {}
    kernel = {"kernel_fp16": base.replace(kv_format="fp16"),
              "kernel_int4": base.replace(kv_format="int4", kv_int4_fp16_tail=False),   # = k32_v64
              "kernel_int4_fp16_tail": base.replace(kv_format="int4")}    # the default: K and V tail
    for key, config in kernel.items():
        runs[key] = perplexity(config, text, PREFIX, a.chunks, loaded, a.context)
        print(f"{key}: {runs[key]['perplexity']:.3f}", flush=True)
    for scheme in a.schemes:
        k_s, v_s = SCHEMES[scheme]
        r = perplexity(base.replace(attention="torch"), text, PREFIX, a.chunks, loaded, a.context,
                       make_backend=lambda spec, k_s=k_s, v_s=v_s: FakeInt4Attention(spec, k_s, v_s))
        r.update(kv_format=f"int4 simulated: K {k_s[0]} groups of {k_s[1]}, V {v_s[0]} groups of {v_s[1]}")
        runs[scheme] = r
        print(f"{scheme}: {r['perplexity']:.3f}", flush=True)
    fp16 = runs["kernel_fp16"]["perplexity"]
    result = {"bench": "int4_grouping", "model": Path(a.model).name, "text": name,
              "context": runs["kernel_fp16"]["context"], "chunks": a.chunks, "runs": runs,
              "over_fp16": {k: r["perplexity"] / fp16 for k, r in runs.items()},
              "simulation_check": runs["k32_v64"]["perplexity"] / runs["kernel_int4"]["perplexity"]
              if "k32_v64" in runs else None,
              "note": "channel schemes keep the newest < N tokens of each group in fp16 (KIVI's residual)",
              "wall_s": time.perf_counter() - t0}
    result["best"] = min((k for k in runs if k != "kernel_fp16"), key=lambda k: runs[k]["perplexity"])
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    print(f"wrote {write_results(result, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
