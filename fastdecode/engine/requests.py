"""The engine's request table: every live request, waiting or running, by id.

add_request and abort come from other threads; the step moves sequences between the
lists. One lock guards it all, held only for the moves themselves. Only the step thread
changes `running`, so the step reads it without the lock.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Callable

from fastdecode.engine.errors import EngineOverloadedError, InvalidRequestError
from fastdecode.engine.sequence import Sequence, Status


class RequestTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.aborts: set[str] = set()          # request ids to cancel at the next chance
        self._seq_ids = itertools.count(1)

    def add(self, request_id: str, make: Callable[[int], Sequence], max_waiting: int) -> Sequence:
        """Queue the sequence make(seq_id) builds (it may raise to refuse the request)."""
        with self.lock:
            if request_id in self.by_id:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if len(self.waiting) >= max_waiting:
                raise EngineOverloadedError(f"{len(self.waiting)} requests are waiting (limit "
                                            f"{max_waiting}); retry later")
            seq = make(next(self._seq_ids))
            self.by_id[request_id] = seq
            self.waiting.append(seq)
        return seq

    def mark_abort(self, request_id: str) -> bool:
        """Mark a live request for cancelling; False if there is none by that id."""
        with self.lock:
            seq = self.by_id.get(request_id)
            if seq is None or seq.finished:
                return False
            self.aborts.add(request_id)
        return True

    def take_aborts(self) -> list[Sequence]:
        with self.lock:
            ids, self.aborts = self.aborts, set()
            return [self.by_id[r] for r in ids if r in self.by_id]

    def head(self, max_running: int) -> list[Sequence]:
        """The first waiting sequences, as many as the batch has places for."""
        with self.lock:
            room = max(0, max_running - len(self.running))
            return list(itertools.islice(self.waiting, room))

    def start_running(self, seqs: list[Sequence]) -> None:
        with self.lock:
            for s in seqs:
                self.waiting.remove(s)
                s.status = Status.RUNNING
                self.running.append(s)

    def requeue_first(self, seqs: list[Sequence]) -> None:
        """Running sequences back to the head of the line, oldest first."""
        with self.lock:
            for s in sorted(seqs, key=lambda s: s.seq_id, reverse=True):
                self.running.remove(s)
                s.status = Status.WAITING
                self.waiting.appendleft(s)

    def remove(self, s: Sequence, was_running: bool) -> None:
        with self.lock:
            if was_running:
                self.running.remove(s)
            elif s in self.waiting:
                self.waiting.remove(s)
            self.by_id.pop(s.request_id, None)
            self.aborts.discard(s.request_id)

    def unfinished(self) -> list[Sequence]:
        with self.lock:
            return list(self.running) + list(self.waiting)

    def has_unfinished(self) -> bool:
        with self.lock:
            return bool(self.waiting or self.running)

    def counts(self) -> tuple[int, int]:
        """(running, waiting)"""
        with self.lock:
            return len(self.running), len(self.waiting)
