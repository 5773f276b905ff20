"""SLS admission on random traffic (hypothesis), with test_sls.py's simulated engine: the context in
flight never exceeds W_lim (given or derived), no request starves, waits are bounded; against FCFS."""
from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from fastdecode.scheduler.fcfs import FCFSScheduler
from fastdecode.scheduler.sls import SLSScheduler

from test_sls import FAST, Req, simulate


traffic = st.lists(
    st.tuples(st.integers(0, 60), st.integers(0, 24), st.integers(1, 40), st.floats(0, 1)),
    min_size=1, max_size=60)


def make_reqs(spec, early: bool) -> list[Req]:
    out = []
    for arrival, prompt, max_tokens, u in spec:
        actual = max(1, round(u * max_tokens)) if early else max_tokens
        out.append(Req(arrival, prompt, max_tokens, actual))
    return out


@FAST
@given(spec=traffic, early=st.booleans(), f=st.integers(1, 12), slack=st.integers(0, 400),
       max_running=st.integers(1, 64), max_prefill=st.integers(1, 200))
def test_context_in_flight_never_exceeds_w_lim(spec, early, f, slack, max_running, max_prefill):
    reqs = make_reqs(spec, early)
    w_lim = max(r.prompt + r.max_tokens for r in reqs) + slack
    sched = SLSScheduler(max_running, max_prefill, f, w_lim=w_lim)

    def check(s, t, cands, num_running, n):
        # The admitted prefix fits; one more (within capacity and cap) would not.
        assert s.plan.peak(t, cands[:n]) <= w_lim
        if num_running or len(s.plan):
            limit = min(s.capacity(cands, num_running), s.micro_batch_size(cands))
            if n < limit and t >= s.next_admit:
                assert s.plan.peak(t, cands[: n + 1]) > w_lim

    run = simulate(sched, reqs, 5000, check)
    assert max(run.loads) <= w_lim
    assert max(run.batch) <= max_running
    assert run.predicted_ok, "the plan's load_at(t) must equal the simulated context in flight"
    # No starvation: everything ran; FCFS: admitted in arrival order.
    assert all(r.finished >= 0 for r in reqs)
    by_arrival = sorted(reqs, key=lambda r: r.arrival)
    assert [r.admitted for r in by_arrival] == sorted(r.admitted for r in by_arrival)


@FAST
@given(spec=traffic, early=st.booleans(), f=st.integers(1, 12), max_running=st.integers(1, 64))
def test_derived_w_lim_bounds_every_shared_admission(spec, early, f, max_running):
    """sls_w_lim = 0 (the default): W_lim is derived from the traffic seen so far; every
    admission beside other work keeps the predicted peak under the W_lim of that moment,
    and the context in flight stays under the largest W_lim in force (a request longer
    than W_lim runs only alone, on an idle system)."""
    reqs = make_reqs(spec, early)
    sched = SLSScheduler(max_running, 10**6, f)
    limits = []

    def check(s, t, cands, num_running, n):
        if not n:
            return
        w_lim = s.w_lim(cands)
        limits.append(w_lim)
        alone = num_running == 0 and len(s.plan) == 0 and n == 1 and cands[0].max_len > w_lim
        if alone:
            limits.append(cands[0].max_len)
        else:
            assert s.plan.peak(t, cands[:n]) <= w_lim

    run = simulate(sched, reqs, 20_000, check)
    assert all(r.finished >= 0 for r in reqs)
    assert max(run.loads) <= max(limits)


@FAST
@given(spec=traffic, early=st.booleans(), f=st.integers(1, 12), max_running=st.integers(1, 16))
def test_no_request_starves(spec, early, f, max_running):
    """Tight W_lim (the longest request): the head of the queue waits at most the
    longest lifetime plus F, however much traffic is behind it."""
    reqs = make_reqs(spec, early)
    w_lim = max(r.prompt + r.max_tokens for r in reqs)
    sched = SLSScheduler(max_running, 10**6, f, w_lim=w_lim)
    run = simulate(sched, reqs, 10_000)
    assert all(r.finished >= 0 for r in reqs)
    longest = max(r.max_tokens for r in reqs)
    n_ahead_bound = len(reqs)
    for r in reqs:
        assert r.admitted - r.arrival <= n_ahead_bound * (longest + f)
    # Head-of-line wait: from the step a request becomes the head to its admission.
    order = sorted(reqs, key=lambda r: (r.arrival, r.admitted))
    prev_admit = -1
    for r in order:
        became_head = max(r.arrival, prev_admit)
        assert r.admitted - became_head <= max(longest, f), (r, became_head)
        prev_admit = r.admitted


@FAST
@given(spec=traffic, f=st.integers(1, 12))
def test_wait_at_most_f_while_under_w_lim(spec, f):
    """W_lim and the batch limits never bind: every request waits < F steps."""
    reqs = make_reqs(spec, early=True)
    sched = SLSScheduler(10**6, 10**6, f, w_lim=10**9, micro_batch=10**6)
    run = simulate(sched, reqs, 5000)
    assert max(r.admitted - r.arrival for r in reqs) <= f - 1
    # Admissions are F apart unless the system was idle in between.
    for a, b in zip(run.admit_steps, run.admit_steps[1:]):
        idle_before_b = all(r.finished < b for r in reqs if 0 <= r.admitted < b)
        assert b - a >= f or idle_before_b


@FAST
@given(spec=traffic, f=st.integers(1, 12), m=st.integers(1, 6))
def test_wait_bounded_by_micro_batches_ahead(spec, f, m):
    """With the micro-batch cap on (M = m) and W_lim not binding, a request with q requests
    waiting ahead of it when it arrives is admitted within ceil((q + 1) / M) admission
    slots, F apart: its wait is below F * ceil((q + 1) / M) steps. With q < M (arrivals at
    the rate the schedule admits) that is the paper's "at most F steps"."""
    reqs = make_reqs(spec, early=True)
    sched = SLSScheduler(10**6, 10**6, f, w_lim=10**9, micro_batch=m)
    simulate(sched, reqs, 20_000)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    for pos, i in enumerate(order):
        r = reqs[i]
        ahead = sum(1 for j in order[:pos] if reqs[j].admitted >= r.arrival)
        assert r.admitted >= r.arrival
        assert r.admitted - r.arrival <= f * -(-(ahead + 1) // m) - 1, (r, ahead)


def test_sls_against_fcfs_on_random_traffic():
    """Same mixed traffic: SLS bounds the peak context, FCFS does not; SLS still finishes
    every request, at most a bounded number of steps later."""
    rng = random.Random(7)
    spec = [(rng.randint(0, 400), rng.randint(1, 32), rng.randint(16, 96), rng.random()) for _ in range(600)]
    B, F = 48, 8
    sls = SLSScheduler(B, 4096, F)
    r_sls = simulate(sls, make_reqs(spec, early=False), 20_000)
    r_fcfs = simulate(FCFSScheduler(B, 4096), make_reqs(spec, early=False), 20_000)
    assert max(r_sls.loads) <= sls.w_lim() < max(r_fcfs.loads)
    assert all(r.finished >= 0 for r in r_sls.reqs)
    assert len(r_sls.loads) < 1.6 * len(r_fcfs.loads)
