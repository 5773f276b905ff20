"""The micro-benchmarks behind the performance model: T(B) and H(B) of the engine's own
layers (torch), R of the C++ KVStore or of any AttentionBackend, fitted into a PerfModel."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Sequence

from fastdecode.perfmodel import DEFAULT_BATCHES, DEFAULT_CONTEXTS, Curve, PerfModel, fit_line


def _timeit(fn, repeats: int, sync=lambda: None) -> tuple[float, float]:
    """(median, min) seconds of `repeats` calls after one warm-up call. The median is the
    model's figure; the min is the noise floor, for comparing with the fastest engine
    steps on a machine shared with other work."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def measure_s_part(model_dir: str, batches: Sequence[int] = DEFAULT_BATCHES, device: str = "cpu",
                   dtype: str = "float32", repeats: int = 5, layers: int = 2) -> tuple[dict, dict, dict]:
    """T(B) and H(B) of the engine's code on `device`. T: the engine's ModelRunner decoding
    one mini-batch of B through `layers` layers with an attention backend that costs
    nothing (so the runner's per-layer work -- host copies of q/k/v, futures -- counts
    with the layer's GEMMs and norms), less embedding + LM head, per layer. H: embedding +
    LM head + the engine's sampler + one incremental detokenizer push per sequence (the
    S-worker's per-step host work). Weights are random: only the shapes matter for time.
    Returns (T points, H points, model shape); points map B -> (median, min) seconds."""
    from concurrent.futures import Future

    import torch

    from fastdecode.attention.base import AttentionBackend, KVSpec
    from fastdecode.engine.detokenizer import IncrementalDetokenizer
    from fastdecode.engine.model_runner import ModelRunner
    from fastdecode.engine.sampling import SamplingParams, sample
    from fastdecode.model.llama import LlamaModel, ModelArgs
    from fastdecode.model.loader import DTYPES
    from fastdecode.model.fused import fuse_layers
    from fastdecode.model.packed import pack_linears
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = ModelArgs.from_hf(cfg)
    n = max(1, min(layers, args.num_layers))
    small = ModelArgs(**{**asdict(args), "num_layers": n})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(small, cfg, 4096).to(DTYPES[dtype]).eval()
    model.rope.build(device)
    model.requires_grad_(False)
    pack_linears(model)                            # as load_model does: the engine's S-Part
    fuse_layers(model)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    class FreeAttention(AttentionBackend):        # o = 0 at once: only the S-worker's side is timed
        def open(self, seq_ids): pass
        def close(self, seq_ids): pass
        def prefill(self, layer, seq_ids, lens, k, v): pass

        def submit_decode(self, layer, seq_ids, q, k, v):
            fut: Future = Future()
            fut.set_result(torch.zeros(q.shape, dtype=torch.float32))
            return fut

    runner = ModelRunner(model, FreeAttention(KVSpec(n, args.num_heads, args.num_kv_heads, args.head_dim)),
                         device, 1)
    t_points, h_points = {}, {}
    with torch.inference_mode():
        for b in batches:
            pos = torch.randint(0, 2048, (b,), device=device)
            tok = torch.randint(0, args.vocab_size, (b,), device=device)
            ids, tok_list, pos_list = list(range(b)), tok.tolist(), pos.tolist()

            def runner_step() -> None:
                runner.decode(ids, tok_list, pos_list)

            def ends() -> None:
                model.logits(model.embed(tok))

            greedy = [SamplingParams(temperature=0.0)] * b
            detoks = [IncrementalDetokenizer(tokenizer) for _ in range(b)]

            def head_step() -> None:
                tokens = sample(model.logits(model.embed(tok)), greedy, [None] * b).tolist()
                for d, t in zip(detoks, tokens):
                    d.push(t)

            total, outer = _timeit(runner_step, repeats, sync), _timeit(ends, repeats, sync)
            # median and min of a difference of two separately timed calls: subtracting the
            # pairs term by term can put the min above the median, so cap it there
            med, low = (max(a - o, 0.05 * a) / n for a, o in zip(total, outer))
            t_points[b] = (med, min(low, med))
            h_points[b] = _timeit(head_step, repeats, sync)
    shape = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_heads": args.num_heads,
             "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
             "intermediate_size": args.intermediate_size, "vocab_size": args.vocab_size}
    return t_points, h_points, shape


def measure_r_part(num_kv_heads: int, num_heads: int, head_dim: int, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                   num_seqs: int = 32, threads: int = 0, kv_format: str = "fp16", repeats: int = 5) -> tuple[dict, str]:
    """Seconds (median, min) of one layer's decode (append + attend) over `num_seqs`
    sequences holding `context` tokens in total, on one in-process KVStore (an R-worker's
    kernel). Falls back to the plain-torch reference when the kernel is not built."""
    import numpy as np

    rng = np.random.default_rng(0)
    points = {}
    try:
        from rpart.kernels import KVStore
    except ImportError:
        return _measure_r_torch(num_kv_heads, num_heads, head_dim, contexts, num_seqs, repeats), "torch_ref"
    per_token = 2 * num_kv_heads * head_dim * (2 if kv_format == "fp16" else 1)
    for ctx in contexts:
        each = max(1, ctx // num_seqs)
        store = KVStore(1, num_kv_heads, head_dim, capacity_bytes=int(per_token * (each + 64 + repeats * 2) * num_seqs
                                                                     * 1.5) + (64 << 20),
                        kv_format=kv_format, num_threads=threads)
        ids = list(range(num_seqs))
        store.create(ids)
        kv = rng.standard_normal((each * num_seqs, num_kv_heads, head_dim), dtype=np.float32).astype(np.float16)
        store.append_span(0, ids, [each] * num_seqs, kv, kv)
        q = rng.standard_normal((num_seqs, num_heads, head_dim), dtype=np.float32)
        k1 = rng.standard_normal((num_seqs, num_kv_heads, head_dim), dtype=np.float32)
        points[each * num_seqs] = _timeit(lambda: store.decode(0, ids, q, k1, k1), repeats)
        store.close()
    return points, f"kernels.KVStore({kv_format}, threads={threads or 'all'})"


def _measure_r_torch(num_kv_heads, num_heads, head_dim, contexts, num_seqs, repeats) -> dict:
    import torch

    from fastdecode.attention.base import KVSpec
    from fastdecode.attention.torch_ref import TorchAttention

    points = {}
    for ctx in contexts:
        each = max(1, ctx // num_seqs)
        be = TorchAttention(KVSpec(1, num_heads, num_kv_heads, head_dim))
        ids = list(range(num_seqs))
        be.open(ids)
        kv = torch.randn(each * num_seqs, num_kv_heads, head_dim)
        be.prefill(0, ids, [each] * num_seqs, kv, kv)
        q = torch.randn(num_seqs, num_heads, head_dim)
        k1 = torch.randn(num_seqs, num_kv_heads, head_dim)
        points[each * num_seqs] = _timeit(lambda: be.decode(0, ids, q, k1, k1), repeats)
    return points


def measure_r_backend(backend, contexts: Sequence[int] = DEFAULT_CONTEXTS, num_seqs: int = 32,
                      repeats: int = 5) -> dict:
    """R-Part seconds (median, min) of one layer's submit_decode(...).result() through an AttentionBackend
    (e.g. the remote one: transport included) over `num_seqs` sequences holding `context`
    tokens in total. Opens and closes its own sequences (ids from 2**39 up)."""
    import torch

    spec = backend.spec
    gen = torch.Generator().manual_seed(0)
    points = {}
    for j, ctx in enumerate(contexts):
        each = max(1, ctx // num_seqs)
        ids = [(1 << 39) + j * num_seqs + i for i in range(num_seqs)]
        backend.open(ids)
        try:
            kv = torch.randn(each * num_seqs, spec.num_kv_heads, spec.head_dim, generator=gen)
            backend.prefill(0, ids, [each] * num_seqs, kv, kv)
            q = torch.randn(num_seqs, spec.num_heads, spec.head_dim, generator=gen)
            k1 = torch.randn(num_seqs, spec.num_kv_heads, spec.head_dim, generator=gen)
            points[each * num_seqs] = _timeit(lambda: backend.decode(0, ids, q, k1, k1), repeats)
        finally:
            backend.close(ids)
    return points


def build_perf_model(model_dir: str, device: str = "cpu", dtype: str = "float32",
                     batches: Sequence[int] = DEFAULT_BATCHES, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                     threads: int = 0, kv_format: str = "fp16", repeats: int = 5, backend=None) -> PerfModel:
    """Measure and fit (medians). R through `backend` (an AttentionBackend, all its
    R-workers as one) when given, else on one in-process KVStore with `threads` threads.
    meta["floor"] holds the same curves from the fastest repeat (see floor_model)."""
    t_pts, h_pts, shape = measure_s_part(model_dir, batches, device, dtype, repeats)
    if backend is not None:
        r_pts, r_backend = measure_r_backend(backend, contexts, repeats=repeats), type(backend).__name__
    else:
        r_pts, r_backend = measure_r_part(shape["num_kv_heads"], shape["num_heads"], shape["head_dim"], contexts,
                                          threads=threads, kv_format=kv_format, repeats=repeats)
    models = []
    for which in (0, 1):              # median, min
        r0, r = fit_line(list(r_pts), [v[which] for v in r_pts.values()])
        if r <= 0:
            raise RuntimeError(f"R-Part time did not grow with context ({r_pts}): measurement too noisy")
        models.append((Curve.of({b: v[which] for b, v in t_pts.items()}),
                       Curve.of({b: v[which] for b, v in h_pts.items()}), r, max(r0, 0.0)))
    (t, h, r, r0), (tf, hf, rf, rf0) = models
    return PerfModel(shape["num_layers"], t, h, r, r0, {
        "model": str(model_dir), "device": _device_name(device), "dtype": dtype, "shape": shape,
        "r_backend": r_backend, "r_points": {str(k): v[0] for k, v in r_pts.items()}, "repeats": repeats,
        "measured_at": time.time(),
        "floor": {"s_layer": tf.to_dict(), "s_head": hf.to_dict(), "r_per_token_s": rf, "r_fixed_s": rf0}})


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device
