"""Which worker group holds each sequence.

open() places each sequence on the live group with the least KV load (tokens), all or
nothing: ids a group refuses for capacity (its --max-sequences) go to groups with room (the
refusing one is offered fewer); when none has room, nothing stays open (here or on a worker)
and KVCapacityError is raised. A worker that goes down loses every sequence of its group:
they stay known as lost (placement None) until the engine re-opens them.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Sequence

import grpc
import numpy as np

from fastdecode.attention.base import AttentionError, KVCapacityError, KVSpec
from fastdecode.attention.remote.connection import WorkerConnection, WorkerLost, reply_error
from fastdecode.attention.remote.fleet import Fleet, WorkerGroup
from rpart.proto import rworker_pb2 as pb

log = logging.getLogger("fastdecode.remote")


class Placement(Fleet):
    """Sequences placed on the fleet's groups, with their KV load in tokens."""

    def __init__(self, spec: KVSpec, config) -> None:
        super().__init__(spec, config)
        self.lock = threading.RLock()
        self.placement: dict[int, WorkerGroup | None] = {}    # None: lost, waiting for the engine to re-open it
        self.lost_reason: dict[int, str] = {}
        self.seq_tokens: dict[int, int] = {}
        self._plans: dict[tuple, tuple] = {}
        self.lost_total = 0

    def _worker_down(self, w: WorkerConnection, reason: str) -> None:
        """A member is down: every sequence of its group is lost; free them on the other members."""
        g = self.group_of_worker[w.index]
        with self.lock:
            lost = list(g.seqs)
            for s in lost:
                self.placement[s] = None
                self.lost_reason[s] = f"R-worker {w.address} down: {reason}"
                self.seq_tokens[s] = 0
            g.seqs.clear()
            g.tokens = 0
            self.lost_total += len(lost)
            self._plans.clear()
        if lost:
            for other in g.workers:
                if other is not w and other.up:
                    other.send(pb.Request(close=pb.Close(seq_ids=lost)))
            log.warning("%d sequence(s) lost with R-worker %s", len(lost), w.address)

    def open(self, seq_ids: Sequence[int]) -> None:
        """All or nothing: every id is opened (each on one live group) or, on error, none is.
        A group that refuses k ids for capacity (RESOURCE_EXHAUSTED: its --max-sequences or its
        pool) is offered at most k // 2 of them again in this call, the rest go to the other
        groups; KVCapacityError is raised when no live group has room left."""
        seq_ids = [int(s) for s in seq_ids]
        with self.lock:
            dup = [s for s in seq_ids if self.placement.get(s) is not None]
            was_lost = {s: self.lost_reason.get(s, "lost") for s in seq_ids if s in self.placement}
        if dup or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence(s) already open: {dup[:8] or seq_ids[:8]}")
        opened: list[int] = []               # placed by this call: undone if it fails
        room: dict[int, int] = {}            # group index -> at most this many more, in this call
        refusals: dict[int, str] = {}        # group index -> its last capacity refusal
        todo = seq_ids
        # Rounds: failed groups (down, draining) and halvings of a refusing group's room.
        rounds = 2 * len(self.workers) + 2 + len(self.groups) * max(1, len(seq_ids)).bit_length()
        try:
            for _ in range(rounds):
                if not todo:
                    return
                todo = self._open_once(todo, opened, room, refusals)
            if todo:
                raise AttentionError(f"could not place {len(todo)} sequence(s) on any R-worker")
        except BaseException:
            self.close(opened)               # frees them on their workers too (ordered on the stream)
            with self.lock:                  # lost ones stay lost, for the engine to re-open
                for s, reason in was_lost.items():
                    if s not in self.placement:
                        self.placement[s], self.lost_reason[s] = None, reason
                self._plans.clear()
            raise

    def _open_once(self, seq_ids: list[int], opened: list[int], room: dict[int, int],
                   refusals: dict[int, str]) -> list[int]:
        """Place and open; appends the ids now open to `opened`, lowers `room` of the groups
        that refused for capacity (and of those that took ids), and returns the ids that must
        be placed again (their group failed, or no group had room in this round)."""
        groups = [g for g in self.groups if g.accepting and room.get(g.index, 1) > 0]
        if not any(g.accepting for g in self.groups):     # not when they are only full
            self._revive_all()
            groups = [g for g in self.groups if g.accepting and room.get(g.index, 1) > 0]
        if not groups:
            if refusals:
                raise KVCapacityError(f"no R-worker has room for {len(seq_ids)} more sequence(s), none opened: "
                                      + "; ".join(refusals.values())[:1000])
            states = "; ".join(f"{w.address}: {'draining' if w.up else 'down (' + w.reason + ')'}"
                               for w in self.workers)
            raise AttentionError(f"no R-worker available for new sequences ({states})")
        chosen = self._place(seq_ids, groups, room)
        placed = {s for ids in chosen.values() for s in ids}
        retry = [s for s in seq_ids if s not in placed]
        calls = []
        for g, ids in chosen.items():
            for w in g.workers:
                calls.append((g, w, ids, w.send(pb.Request(open=pb.Open(seq_ids=ids)))))
        error = None
        failed_groups = set()
        for g, w, ids, fut in calls:
            try:
                reply = fut.result(timeout=self.timeout + 1.0)
            except (WorkerLost, FutureTimeout) as e:
                if isinstance(e, FutureTimeout):
                    w.fail(w.generation, f"no reply to Open within {self.timeout:g} s")
                failed_groups.add(g.index)
                continue
            if reply.code == grpc.StatusCode.UNAVAILABLE.value[0]:      # draining
                w.draining = True
                failed_groups.add(g.index)
            elif reply.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:   # no room for all of ids
                room[g.index] = min(room.get(g.index, len(ids)), len(ids) // 2)
                refusals[g.index] = f"{w.address}: {reply.message}"
                failed_groups.add(g.index)
            elif reply.code:
                error = error or reply_error(w.address, reply)
                failed_groups.add(g.index)
        with self.lock:
            for g, ids in chosen.items():
                if g.index in failed_groups:
                    for w in g.workers:            # undo the members that did open them
                        if w.up:
                            w.send(pb.Request(close=pb.Close(seq_ids=ids)))
                    retry.extend(ids)
                    continue
                for s in ids:
                    self.placement[s] = g
                    self.lost_reason.pop(s, None)
                    self.seq_tokens[s] = 0
                    g.seqs.add(s)
                opened.extend(ids)
                if g.index in room:
                    room[g.index] -= len(ids)
            self._plans.clear()
        if error is not None:
            raise error
        return retry

    def _place(self, seq_ids: list[int], groups: list[WorkerGroup],
               room: dict[int, int] | None = None) -> dict[WorkerGroup, list[int]]:
        """Least KV load (tokens) first. A new, still empty sequence counts as the mean length
        of those already placed, so a batch of opens spreads instead of piling on one group.
        A group gets at most room[index] ids (when given); ids no group has room for are left out."""
        room = dict(room or {})
        with self.lock:
            n = sum(len(g.seqs) for g in self.groups)
            mean = max(1.0, sum(g.tokens for g in self.groups) / n) if n else 1.0
            load = {g: g.tokens + mean * sum(1 for s in g.seqs if self.seq_tokens.get(s, 0) == 0) for g in groups}
        chosen: dict[WorkerGroup, list[int]] = {}
        for s in seq_ids:
            fit = [g for g in groups if room.get(g.index, 1) > 0]
            if not fit:
                break
            g = min(fit, key=lambda g: (load[g], g.index))
            chosen.setdefault(g, []).append(s)
            load[g] += mean
            if g.index in room:
                room[g.index] -= 1
        return chosen

    def close(self, seq_ids: Sequence[int]) -> None:
        by_group: dict[WorkerGroup, list[int]] = {}
        with self.lock:
            for s in seq_ids:
                s = int(s)
                g = self.placement.pop(s, None)
                self.lost_reason.pop(s, None)
                tokens = self.seq_tokens.pop(s, 0)
                if g is not None:
                    g.seqs.discard(s)
                    g.tokens -= tokens
                    by_group.setdefault(g, []).append(s)
            self._plans.clear()
        for g, ids in by_group.items():
            for w in g.workers:
                w.send(pb.Request(close=pb.Close(seq_ids=ids)))   # ordered on the stream; no wait

    def _plan(self, seq_ids: Sequence[int]):
        """Rows of the batch per live group, and the rows whose KV is lost; cached per batch."""
        key = tuple(map(int, seq_ids))
        with self.lock:
            plan = self._plans.get(key)
            if plan is not None:
                return plan
            rows: dict[WorkerGroup, list[int]] = {}
            lost: list[int] = []
            for i, s in enumerate(key):
                if s not in self.placement:
                    raise KeyError(f"unknown sequence id {s}")
                g = self.placement[s]
                if g is None:
                    lost.append(i)
                else:
                    rows.setdefault(g, []).append(i)
            parts = [(g, np.asarray(r, dtype=np.int64), [key[i] for i in r]) for g, r in rows.items()]
            plan = (parts, np.asarray(lost, dtype=np.int64))
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = plan
            return plan
