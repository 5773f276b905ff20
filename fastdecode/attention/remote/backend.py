"""RemoteAttention: the AttentionBackend the engine sees when attention=remote.

open/close come from Placement, available/shutdown from Fleet; this adds the calls that
carry KV and queries. submit_decode() ships each worker the q, k, v rows of its sequences
as one message on its long-lived stream and returns a Future at once. A worker whose
stream breaks, or that misses the deadline (rworker_timeout_s), is marked down: its
sequences' futures raise SequencesLost (with o valid for the other rows); the engine
re-opens them (placed on live groups) and re-prefills.
"""
from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import numpy as np
import torch

from fastdecode.attention.base import AttentionBackend, KVCapacityError, KVSpec, SequencesLost
from fastdecode.attention.remote.connection import WorkerLost, reply_error
from fastdecode.attention.remote.gather import DecodeGather
from fastdecode.attention.remote.messages import decode_chunk_rows, kv_wire, prefill_chunks, q_wire
from fastdecode.attention.remote.placement import Placement
from rpart.proto import rworker_pb2 as pb
from rpart.wire import encode_decode_request, keep_freed_memory, to_tensor

INT4_K_GROUP, INT4_V_GROUP = 32, 64     # the kernel's default int4 groups (csrc/common.h), an R-worker's too


def _int4_group(most: int, head_dim: int) -> int:
    """The kernel's default group: the largest of most, most/2, ... (down to 16) dividing head_dim."""
    g = most
    while g > 16 and head_dim % g:
        g //= 2
    return g


def kv_bytes_per_token_head(kv_format: str, head_dim: int) -> int:
    """K and V of one token of one kv head in one layer, as an R-worker's store keeps them:
    fp16, or int4 with an fp16 scale and zero per group of channels (value nibbles fill lines
    of 32 channels). At head_dim 128: 512 (fp16), 152 (int4). A worker started with other
    --int4-k-group/--int4-v-group holds a few bytes more or less."""
    if kv_format == "fp16":
        return 2 * 2 * head_dim
    k_groups = head_dim // _int4_group(INT4_K_GROUP, head_dim)
    v_groups = head_dim // _int4_group(INT4_V_GROUP, head_dim)
    v_channels = -(-head_dim // 32) * 32
    return head_dim // 2 + 4 * k_groups + v_channels // 2 + 4 * v_groups


class RemoteAttention(Placement, AttentionBackend):
    def __init__(self, spec: KVSpec, config) -> None:
        AttentionBackend.__init__(self, spec)
        keep_freed_memory()                  # message buffers reused, not page-faulted in per call
        Placement.__init__(self, spec, config)
        self.decode_backstop_s = 3 * self.timeout + 5.0      # the monitor fails overdue calls long before
        self.kv_format = config.kv_format
        self.decode_calls, self.decode_wall_s, self.decode_kernel_s, self.decode_handler_s = 0, 0.0, 0.0, 0.0
        self.decode_submit_s = 0.0           # inside submit_decode: conversion, row gathering, message building
        # Per decode call, for benchmarks: perf_counter_ns stamps of submit, submit_decode's return,
        # the future's resolution and per reply the worker's (same host: same clock) and ours.
        self.call_trace: collections.deque = collections.deque(maxlen=4096)
        self.start()

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.spec.num_layers})")

    def submit_decode(self, layer, seq_ids, q, k, v) -> Future:
        t0 = time.perf_counter()
        self._check_layer(layer)
        spec, b = self.spec, len(seq_ids)
        if q.shape != (b, spec.num_heads, spec.head_dim) or k.shape != (b, spec.num_kv_heads, spec.head_dim) \
                or v.shape != k.shape:
            raise ValueError(f"decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match "
                             f"{b} sequences of {spec}")
        parts, lost_rows = self._plan(seq_ids)
        qn, q_dtype = q_wire(q)
        kn, vn = kv_wire(k, self.kv_format), kv_wire(v, self.kv_format)
        out = torch.empty(b, spec.num_heads, spec.head_dim, dtype=torch.float32)
        row_bytes = (qn[0].nbytes + kn[0].nbytes + vn[0].nbytes) if b else 1
        chunk = decode_chunk_rows(row_bytes, len(self.kv_heads))
        sends = []
        for g, rows, ids in parts:
            whole = len(parts) == 1 and len(rows) == b      # one group holds the batch: no gather copy
            for a in range(0, len(rows), chunk):
                r, r_ids = rows[a:a + chunk], ids[a:a + chunk]
                whole_chunk = whole and len(r) == b
                for w, hq, hk in zip(g.workers, self.q_heads, self.kv_heads):
                    sends.append((w, r, r_ids, hq, hk, whole_chunk))
        gather = DecodeGather(out, seq_ids, len(sends), self, t0)
        if len(lost_rows):
            ids = [seq_ids[i] for i in lost_rows]
            gather.lose(lost_rows, "; ".join(sorted({self.lost_reason.get(s, "lost") for s in ids}))[:500])
        if layer == 0:
            with self.lock:
                for g, rows, ids in parts:
                    g.tokens += len(ids)
                    for s in ids:
                        self.seq_tokens[s] += 1
        if not sends:
            gather.finish()
            return gather.future
        requests = []
        for w, r, r_ids, hq, hk, whole_chunk in sends:
            if whole_chunk and len(self.kv_heads) == 1:
                qa, ka, va = qn, kn, vn
            elif len(self.kv_heads) == 1:            # whole rows: np.take is a row memcpy
                qa, ka, va = qn.take(r, axis=0), kn.take(r, axis=0), vn.take(r, axis=0)
            else:
                qa, ka, va = qn[r, hq], kn[r, hk], vn[r, hk]
            call_id = w.next_id()
            requests.append((call_id, encode_decode_request(call_id, layer, r_ids, qa, ka, va, q_dtype)))
        # Build every message before sending any: a stream's sender thread woken early would
        # contend for the GIL with this one (costly when the OS deschedules the holder).
        gather.encoded_ns = time.perf_counter_ns()
        for (w, r, _, hq, _, _), (call_id, data) in zip(sends, requests):
            fut = w.send_bytes(call_id, data)
            fut.add_done_callback(lambda f, w=w, r=r, hq=hq: gather.part_done(f, w, r, hq))
        self.decode_submit_s += time.perf_counter() - t0
        return gather.future

    def prefill(self, layer, seq_ids, lens, k, v) -> None:
        self._check_layer(layer)
        spec = self.spec
        lens = [int(n) for n in lens]
        if len(lens) != len(seq_ids) or any(n < 0 for n in lens):
            raise ValueError("prefill: need one length >= 0 per sequence")
        want = (sum(lens), spec.num_kv_heads, spec.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"prefill: k {tuple(k.shape)}, v {tuple(v.shape)}, expected {want}")
        parts, lost_rows = self._plan(seq_ids)
        lost = [seq_ids[i] for i in lost_rows]       # the others' KV is stored all the same
        kn, vn = kv_wire(k, self.kv_format), kv_wire(v, self.kv_format)
        starts = np.concatenate([[0], np.cumsum(lens)])
        token_bytes = max(1, kn[0].nbytes * 2 // len(self.kv_heads)) if len(kn) else 1
        calls = []
        for g, rows, ids in parts:
            for chunk_ids, chunk_lens, tok in prefill_chunks(rows, ids, lens, starts, token_bytes):
                for w, hk in zip(g.workers, self.kv_heads):
                    req = pb.Request(prefill=pb.Prefill(layer=layer, seq_ids=chunk_ids, lens=chunk_lens,
                                                        k=to_tensor(kn[tok, hk]), v=to_tensor(vn[tok, hk])))
                    calls.append((g, w, chunk_ids, w.send(req)))
        error, refused = None, []
        for g, w, ids, fut in calls:
            try:
                reply = fut.result(timeout=self.timeout + 1.0)
                if reply.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:     # that worker's only
                    refused.append((ids, f"R-worker {w.address}: {reply.message}"))
                elif reply.code:
                    error = error or reply_error(w.address, reply)
            except FutureTimeout:
                w.fail(w.generation, f"no reply to Prefill within {self.timeout:g} s")
                lost.extend(ids)
            except WorkerLost:
                lost.extend(ids)
        if error is not None:            # fails the call, whatever else went wrong in it
            raise error
        if layer == 0:
            with self.lock:
                for s, n in zip(seq_ids, lens):
                    g = self.placement.get(s)
                    if g is not None:
                        self.seq_tokens[s] += n
                        g.tokens += n
        if refused:                      # lost ones with them: the engine recomputes both alike
            ids = list(dict.fromkeys([s for r, _ in refused for s in r] + lost))
            raise KVCapacityError(refused[0][1], ids)
        if lost:
            lost = list(dict.fromkeys(lost))
            raise SequencesLost(lost, self.lost_reason.get(lost[0], "R-worker lost"))

    def _account(self, wall_s: float, kernel_s: float, handler_s: float) -> None:
        with self.lock:
            self.decode_calls += 1
            self.decode_wall_s += wall_s
            self.decode_kernel_s += kernel_s
            self.decode_handler_s += handler_s

    def stats(self) -> dict:
        spec = self.spec
        per_token = spec.num_layers * spec.num_kv_heads * kv_bytes_per_token_head(self.kv_format, spec.head_dim)
        with self.lock:
            workers = [{"address": w.address, "up": w.up, "draining": w.draining, "reason": "" if w.up else w.reason,
                        "sequences": len(self.group_of_worker[w.index].seqs),
                        "kv_tokens": self.group_of_worker[w.index].tokens,
                        "calls": w.calls, "kernel_s": w.kernel_s} for w in self.workers]
            tokens = sum(g.tokens for g in self.groups)
            return {"sequences": sum(len(g.seqs) for g in self.groups), "kv_tokens": tokens,
                    "kv_bytes": tokens * per_token,
                    "capacity_bytes": sum(w.capacity_bytes for w in self.workers if w.up),
                    "lost_sequences": self.lost_total, "decode_calls": self.decode_calls,
                    "decode_wall_s": self.decode_wall_s, "decode_kernel_s": self.decode_kernel_s,
                    "decode_handler_s": self.decode_handler_s, "decode_submit_s": self.decode_submit_s,
                    "workers": workers}
