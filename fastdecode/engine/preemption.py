"""Recompute preemption (as vLLM's): what to do when the KV store runs out.

Before each decode step the engine asks the backend how much KV is free (kv_room). When
it cannot hold the next token of every running sequence, the youngest (latest arrival)
are preempted: their KV is freed and they wait at the front of the queue. Re-admitted,
they prefill the prompt and every token generated so far, then go on; a Sequence keeps
its output and text, so the client sees one stream and greedy output does not change.
A backend that cannot count its pool (remote: R-workers are shared) refuses in the step
instead (KVCapacityError), and the engine preempts only the refused rows.

Admission keeps WATERMARK of the pool free while sequences run, so that preemption
stays the exception, and refuses up front a prompt that would not fit in the whole pool.
None of it walks the running sequences while free KV is above two pages for each.
"""
from __future__ import annotations

import logging
import time
from typing import Callable
from typing import Sequence as Seq

from fastdecode.attention.base import KVRoom
from fastdecode.engine.sequence import Sequence

log = logging.getLogger("fastdecode.engine")
WATERMARK = 0.01      # of the pool: admission leaves this much free while sequences run
ADMIT_RETRY_S = 0.05  # after the backend refused new KV for capacity: pause before asking again
TOO_LONG = "out of KV capacity: the sequence has outgrown the whole KV store"


def pages(tokens: int, room: KVRoom) -> int:
    return -(-tokens // room.page_tokens)


def decode_fit(room: KVRoom, lengths: Seq[int]) -> int:
    """How many of the sequences with these KV lengths (oldest first) can each append one
    token if the KV of the others is freed; 0: not even the oldest alone."""
    n = len(lengths)
    if room.free_pages >= n:          # a token takes at most one new page
        return n
    page = room.page_tokens
    need = sum(1 for length in lengths if length % page == 0)
    free = room.free_pages
    while n > 0 and need > free:
        n -= 1
        free += pages(lengths[n], room)
        need -= lengths[n] % page == 0
    return n


def growth(room: KVRoom, running: list[Sequence]) -> int:
    """Pages the next decode step of the running sequences takes (at most one each)."""
    if room.free_pages >= 2 * len(running):  # plenty: the bound will do, no walk
        return len(running)
    return sum(1 for s in running if (s.num_tokens - 1) % room.page_tokens == 0)


class KVPlan:
    """The decisions, on the backend's kv_room(); the engine acts on them. Counts preemptions."""

    def __init__(self, kv_room: Callable[[], KVRoom | None]) -> None:
        self.kv_room = kv_room          # the backend's, looked up at each call
        self.preemptions = 0

    def too_long(self, num_tokens: int) -> str | None:
        """Why a sequence of num_tokens (and one more generated) can never fit, or None."""
        room = self.kv_room()
        if room is None or pages(num_tokens + 1, room) <= room.total_pages:
            return None
        return (f"{num_tokens} tokens need more KV than the whole KV store holds "
                f"({room.total_pages * room.page_tokens} tokens)")

    def victims(self, running: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Before a decode step: (sequences to end for lack of KV, sequences to preempt)."""
        room = self.kv_room()
        if room is None or room.free_pages >= len(running):
            return [], []
        order = sorted(running, key=lambda s: s.seq_id)           # oldest first
        lengths = [s.num_tokens - 1 for s in order]               # KV held now
        doomed = []
        while order and (k := decode_fit(room, lengths)) == 0:   # the oldest alone cannot grow
            doomed.append(order.pop(0))
            room = KVRoom(room.page_tokens, room.free_pages + pages(lengths.pop(0), room), room.total_pages)
        preempt = []
        for s in order[k:] if order else []:     # one that could never be re-admitted ends now
            (doomed if pages(s.num_tokens + 1, room) > room.total_pages else preempt).append(s)
        return doomed, preempt

    def admissible(self, waiting: list[Sequence], running: list[Sequence]) -> int:
        """How many of `waiting` (in order) to prefill now: each takes the pages of its tokens
        and of its first generated one, and the running ones' next token and a watermark stay
        free (no watermark when nothing runs: the head always gets in when it fits at all)."""
        room = self.kv_room()
        if room is None:
            return len(waiting)
        free = room.free_pages - growth(room, running)
        if running:
            free -= max(1, int(room.total_pages * WATERMARK))
        n = 0
        for s in waiting:
            free -= pages(s.num_tokens + 1, room)
            if free < 0:
                break
            n += 1
        return n


class KVBackoff:
    """Admission after the backend refused KV for capacity (its open, or a step's refused rows):
    ask again once a running sequence has freed its KV or ADMIT_RETRY_S has passed (other
    clients of the R-workers free theirs too). With nothing running, wait out the pause in
    the step rather than spin. After k sequences were refused in a step, admit at most k // 2
    at once until KV is freed: re-admitting all of them could be refused again and again."""

    def __init__(self) -> None:
        self.refused_at: float | None = None     # None: no refusal pending
        self.retry_at = 0.0
        self.frees = 0                           # KV frees by running sequences
        self.frees_at_refusal = 0
        self.cap: int | None = None

    def due(self, running: bool) -> bool:
        if self.refused_at is None or self.frees != self.frees_at_refusal:
            return True
        delay = self.retry_at - time.monotonic()
        if delay > 0 and not running:
            time.sleep(delay)
            delay = 0
        return delay <= 0

    def limit(self) -> int | None:
        """The most sequences to admit now (None: no limit)."""
        return self.cap if self.frees == self.frees_at_refusal else None

    def refused(self, reason, num_waiting: int, cap: int | None = None) -> None:
        now = time.monotonic()
        if self.refused_at is None:
            self.refused_at = now
            log.warning("no KV capacity for new sequences (%s); %d request(s) wait for KV to be freed",
                        reason, num_waiting)
        self.retry_at = now + ADMIT_RETRY_S
        self.frees_at_refusal = self.frees
        self.cap = cap

    def accepted(self) -> None:
        if self.refused_at is not None:
            log.info("KV capacity for new sequences again after %.2f s", time.monotonic() - self.refused_at)
            self.refused_at = None
