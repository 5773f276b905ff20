"""One record per engine step: batch, context and where the time went (S-Part, R-Part, waits).

The latest KEEP records stay in memory (Engine.trace); with a path every record is also
appended to that file as a JSON line.
"""
from __future__ import annotations

import json
import time
from collections import deque

from fastdecode.engine.model_runner import StepTimes
from fastdecode.engine.sequence import Sequence

KEEP = 4096


class StepTrace:
    def __init__(self, path: str | None) -> None:
        self.records: deque[dict] = deque(maxlen=KEEP)
        self._file = open(path, "a") if path else None

    def record(self, step: int, t0: float, times: StepTimes, batch_size: int, num_prefill: int,
               running: list[Sequence]) -> None:
        """The step numbered `step` began at perf_counter() t0 and ends now; `running` go on."""
        step_time = time.perf_counter() - t0
        r_time = times.r_busy()
        rec = {"step": step, "time": time.time(), "batch_size": batch_size, "num_prefill": num_prefill,
               "context_tokens": sum(s.num_tokens for s in running),
               "s_time": max(0.0, step_time - times.s_wait - times.backend_calls), "r_time": r_time,
               "s_wait": times.s_wait, "r_wait": max(0.0, step_time - r_time) if times.r_intervals else None,
               "step_time": step_time}
        self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
