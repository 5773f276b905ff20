"""SLS admission (fastdecode/scheduler/sls.py) edge cases: an idle system, early finishes, oversized
requests, garbage settings, configs and requests, late retirement."""
from __future__ import annotations

import pytest

from fastdecode.config import EngineConfig
from fastdecode.scheduler import create_scheduler
from fastdecode.scheduler.base import Candidate
from fastdecode.scheduler.sls import LoadPlan, SLSScheduler


def test_idle_system_admits_immediately():
    sched = SLSScheduler(4, 10**6, f=50, w_lim=100)
    assert sched.admit(0, [Candidate(1, 3, 10)], 0) == 1
    sched.on_admitted(0, [Candidate(1, 3, 10)])
    # busy and inside the F window: waits
    assert sched.admit(1, [Candidate(2, 3, 10)], 1) == 0
    sched.on_finished(5, 1, 5)           # early finish empties the system
    assert sched.admit(6, [Candidate(2, 3, 10)], 0) == 1     # idle: F does not apply
    st_ = sched.stats()
    assert st_["in_flight"] == 0 and st_["w_lim"] == 100


def test_early_finish_releases_future_load():
    sched = SLSScheduler(8, 10**6, f=1, w_lim=30)
    a = Candidate(1, 0, 20)
    sched.on_admitted(0, [sched_admit_all(sched, 0, [a])])
    b = Candidate(2, 0, 20)
    assert sched.admit(1, [b], 1) == 0                 # 20 + 19 at step 19 > 30
    blocked = sched.stats()
    assert blocked["predicted_peak"] == 20 and blocked["next_admit_step"] == 10   # b at r holds 20 - r at step 19
    sched.on_finished(2, 1, 3)
    assert sched.admit(3, [b], 0) == 1


def sched_admit_all(sched, step, cands):
    assert sched.admit(step, cands, 0) == len(cands)
    return cands[0]


def test_oversized_request_runs_alone_and_check_rejects_it():
    sched = SLSScheduler(4, 10**6, f=2, w_lim=50)
    big = Candidate(1, 40, 20)
    with pytest.raises(ValueError, match="sls_w_lim"):
        sched.check(big)
    sched.check(Candidate(2, 10, 10))
    small = Candidate(3, 1, 5)
    sched.on_admitted(0, [small])
    assert sched.admit(2, [big], 1) == 0               # never beside others
    sched.on_finished(4, 3, 5)
    assert sched.admit(5, [big], 0) == 1               # alone, when idle


@pytest.mark.parametrize("kwargs,match", [
    (dict(f=0), "F"), (dict(f=-3), "F"), (dict(f=2.5), "F"), (dict(f="8"), "F"),
    (dict(f=4, w_lim=-1), "W_lim"), (dict(f=4, w_lim=100, target_len=512), "smaller than one request"),
    (dict(f=4, target_len=-5), "S"), (dict(f=4, micro_batch=-1), "micro_batch"),
])
def test_garbage_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SLSScheduler(16, 1024, **kwargs)


def test_garbage_config_and_requests():
    with pytest.raises(ValueError, match="sls_f"):
        EngineConfig(scheduler="sls", sls_f=0)
    with pytest.raises(ValueError, match="smaller than one request"):
        create_scheduler(EngineConfig(scheduler="sls", sls_w_lim=10, sls_target_len=64))
    sched = create_scheduler(EngineConfig(scheduler="sls", sls_f=4, max_running=8))
    assert isinstance(sched, SLSScheduler) and sched.f == 4
    with pytest.raises(ValueError, match="max_tokens"):
        sched.plan.peak(0, [Candidate(1, 3, 0)])
    with pytest.raises(ValueError, match="prompt_len"):
        sched.plan.add(0, [Candidate(1, -1, 4)])
    plan = LoadPlan()
    plan.add(0, [Candidate(1, 2, 5)])
    with pytest.raises(ValueError, match="already in flight"):
        plan.add(1, [Candidate(1, 2, 5)])
    plan.remove(12345)                                   # unknown id: ignored
    assert plan.load_at(0) == 3


def test_late_retirement_is_never_under_counted():
    """The engine retires a request later than its predicted end: it still counts."""
    sched = SLSScheduler(8, 10**6, f=1, w_lim=20)
    sched.on_admitted(0, [Candidate(1, 0, 10)])        # predicted end: step 9, 10 tokens
    late = Candidate(2, 10, 5)                         # alone: 11..15 tokens, fits
    assert sched.admit(12, [late], 1) == 0             # beside the overdue one (13 at step 12): 24 > 20
    sched.on_finished(12, 1, 10)
    assert sched.admit(13, [late], 0) == 1
