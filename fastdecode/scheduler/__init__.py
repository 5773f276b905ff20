from __future__ import annotations

from fastdecode.scheduler.base import Candidate, Scheduler
from fastdecode.scheduler.fcfs import FCFSScheduler


def create_scheduler(config) -> Scheduler:
    if config.scheduler == "fcfs":
        return FCFSScheduler(config.max_running, config.max_prefill_tokens)
    if config.scheduler == "sls":
        from fastdecode.scheduler.sls import SLSScheduler
        return SLSScheduler.from_config(config)
    raise ValueError(f"unknown scheduler {config.scheduler!r}")


__all__ = ["Candidate", "Scheduler", "FCFSScheduler", "create_scheduler"]
