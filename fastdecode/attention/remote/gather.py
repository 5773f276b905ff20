"""One decode call's replies from several workers (groups, head shards, chunks), written into
one output tensor as they arrive, on the streams' reader threads."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from fastdecode.attention.base import KVCapacityError, SequencesLost
from fastdecode.attention.remote.connection import WorkerConnection, WorkerLost, reply_error
from rpart.wire import WIRE_DTYPES, bf16_to_f32

if TYPE_CHECKING:
    from fastdecode.attention.remote.backend import RemoteAttention


class DecodeGather:
    """Collects the parts of one decode call into `out`; resolves `future` when all are in."""

    def __init__(self, out: torch.Tensor, seq_ids: Sequence[int], parts: int, backend: RemoteAttention,
                 t0: float) -> None:
        self.out, self.out_np = out, out.numpy()
        self.seq_ids, self.backend = seq_ids, backend
        self.future: Future = Future()
        self.lock = threading.Lock()
        self.remaining = parts
        self.lost_rows: list[np.ndarray] = []
        self.refused_rows: list[np.ndarray] = []     # a worker's RESOURCE_EXHAUSTED: only its rows
        self.reason = ""
        self.error: Exception | None = None
        self.kernel_s = 0.0                  # of the slowest part
        self.handler_s = 0.0                 # that part's time in the worker's handler
        self.t0 = t0                         # submit time: conversion and serialisation count as comm
        self.t0_ns = time.perf_counter_ns()
        self.encoded_ns = 0                  # every message built, none sent yet
        self.parts: list[tuple] = []         # per reply: worker's recv_ns, reply_ns, kernel_s; read_ns, decoded_ns

    def lose(self, rows: np.ndarray, reason: str) -> None:
        with self.lock:
            self.lost_rows.append(rows)
            self.reason = self.reason or reason

    def part_done(self, fut: Future, worker: WorkerConnection, rows: np.ndarray, heads: slice) -> None:
        read_ns = time.perf_counter_ns()
        try:
            reply = fut.result()
            if reply.code:
                raise reply_error(worker.address, reply)
            o = reply.o
            a = np.frombuffer(reply.o_data, dtype=WIRE_DTYPES[o.dtype]).reshape(tuple(o.shape))
            self.out_np[rows, heads] = bf16_to_f32(a) if o.dtype == "bfloat16" else a
            worker.kernel_s += reply.kernel_s
            worker.calls += 1
            with self.lock:
                if reply.kernel_s >= self.kernel_s:
                    self.kernel_s, self.handler_s = reply.kernel_s, reply.handler_s
                self.parts.append((reply.recv_ns, reply.reply_ns, reply.kernel_s, read_ns, time.perf_counter_ns()))
        except WorkerLost as e:
            self.lose(rows, str(e))
        except KVCapacityError as e:
            with self.lock:
                self.refused_rows.append(rows)
                self.reason = self.reason or str(e)
        except Exception as e:  # noqa: BLE001 -- handed to the caller through the future
            with self.lock:
                self.error = self.error or e
        with self.lock:
            self.remaining -= 1
            done = self.remaining == 0
        if done:
            self.finish()

    def finish(self) -> None:
        self.backend._account(time.perf_counter() - self.t0, self.kernel_s, self.handler_s)
        if self.parts and self.error is None and not self.lost_rows and not self.refused_rows:
            self.backend.call_trace.append({"submit_ns": self.t0_ns, "encoded_ns": self.encoded_ns,
                                            "done_ns": time.perf_counter_ns(), "parts": self.parts})
        if self.error is not None:
            self.future.set_exception(self.error)
        elif self.refused_rows:          # lost rows with them: the engine recomputes both alike
            rows = np.unique(np.concatenate(self.refused_rows + self.lost_rows))
            self.future.set_exception(KVCapacityError(self.reason, [self.seq_ids[i] for i in rows], self.out))
        elif self.lost_rows:
            rows = np.unique(np.concatenate(self.lost_rows))
            lost = [self.seq_ids[i] for i in rows]
            self.future.set_exception(SequencesLost(lost, self.reason, output=self.out))
        else:
            self.future.set_result(self.out)
