"""First come, first served, limited only by batch size and prefill tokens."""
from __future__ import annotations

from typing import Sequence

from fastdecode.scheduler.base import Candidate, Scheduler


class FCFSScheduler(Scheduler):
    def admit(self, step: int, waiting: Sequence[Candidate], num_running: int) -> int:
        return self.capacity(waiting, num_running)
