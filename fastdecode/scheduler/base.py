"""Admission: which waiting requests join the running batch at this step.

Plain Python, no torch: the scheduler sees only request ids, lengths and counts.
The engine calls, once per step and in this order:
    n = scheduler.admit(step, waiting, num_running)   # admit waiting[:n] (FCFS order)
    scheduler.on_admitted(step, waiting[:n])
and, when a running request ends (any reason, early or not):
    scheduler.on_finished(step, request_id, generated_tokens)
or is preempted (its KV freed; it waits again, and is admitted again as a request of
its prompt and generated tokens with the rest of its max_tokens):
    scheduler.on_preempted(step, request_id)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Candidate:
    request_id: int
    prompt_len: int
    max_tokens: int

    @property
    def max_len(self) -> int:
        """Longest context this request can reach."""
        return self.prompt_len + self.max_tokens


class Scheduler(ABC):
    def __init__(self, max_running: int, max_prefill_tokens: int) -> None:
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens

    def capacity(self, waiting: Sequence[Candidate], num_running: int) -> int:
        """How many of waiting's head fit the batch-size and prefill-token limits.
        At least one prompt is always allowed per step, however long."""
        n, tokens = 0, 0
        room = self.max_running - num_running
        for c in waiting:
            if n >= room or (n > 0 and tokens + c.prompt_len > self.max_prefill_tokens):
                break
            n += 1
            tokens += c.prompt_len
        return n

    @abstractmethod
    def admit(self, step: int, waiting: Sequence[Candidate], num_running: int) -> int:
        ...

    def on_admitted(self, step: int, admitted: Sequence[Candidate]) -> None:
        pass

    def on_finished(self, step: int, request_id: int, generated_tokens: int) -> None:
        pass

    def on_preempted(self, step: int, request_id: int) -> None:
        pass

    def stats(self) -> dict:
        return {}
