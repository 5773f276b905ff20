"""SLS admission (fastdecode/scheduler/sls.py) driven by a simulated engine.

The simulated engine follows the scheduler's convention: a request admitted at
step a with prompt p holds p + (t - a) + 1 tokens of context at step t and
finishes after `actual` generated tokens (<= max_tokens: early stops).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdecode.config import EngineConfig
from fastdecode.scheduler import create_scheduler
from fastdecode.scheduler.base import Candidate
from fastdecode.scheduler.fcfs import FCFSScheduler
from fastdecode.scheduler.sls import LoadPlan, SLSScheduler, paper_w_max

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Req:
    arrival: int
    prompt: int
    max_tokens: int
    actual: int
    admitted: int = -1
    finished: int = -1


@dataclass
class Run:
    loads: list[int] = field(default_factory=list)       # context in flight after each step
    batch: list[int] = field(default_factory=list)
    admit_steps: list[int] = field(default_factory=list)  # steps with an admission
    reqs: list[Req] = field(default_factory=list)
    predicted_ok: bool = True                              # scheduler's load_at(t) == actual load


def simulate(sched, reqs: list[Req], max_steps: int, check=None) -> Run:
    run = Run(reqs=reqs)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    waiting: list[int] = []
    running: dict[int, int] = {}      # id -> tokens generated
    nxt = 0
    for t in range(max_steps):
        while nxt < len(order) and reqs[order[nxt]].arrival <= t:
            waiting.append(order[nxt])
            nxt += 1
        cands = [Candidate(i, reqs[i].prompt, reqs[i].max_tokens) for i in waiting]
        n = sched.admit(t, cands, len(running))
        assert 0 <= n <= sched.capacity(cands, len(running)) or (n == 1 and not running)
        if check:
            check(sched, t, cands, len(running), n)
        sched.on_admitted(t, cands[:n])
        if n:
            run.admit_steps.append(t)
        for i in waiting[:n]:
            reqs[i].admitted = t
            running[i] = 0
        waiting = waiting[n:]
        load = 0
        for i in running:
            running[i] += 1
            load += reqs[i].prompt + running[i]
        if isinstance(sched, SLSScheduler) and sched.plan.load_at(t) != load:
            run.predicted_ok = False
        run.loads.append(load)
        run.batch.append(len(running))
        for i in [i for i, g in running.items() if g >= reqs[i].actual]:
            sched.on_finished(t, i, running.pop(i))
            reqs[i].finished = t
        if nxt == len(order) and not waiting and not running:
            break
    return run


def uniform(count: int, length: int) -> list[Req]:
    """The paper's model: every sequence starts empty and grows to `length`."""
    return [Req(0, 0, length, length) for _ in range(count)]


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


@pytest.mark.parametrize("B,S,F", [(8, 16, 4), (64, 64, 8), (32, 128, 16), (12, 12, 3), (6, 9, 3)])
def test_uniform_steady_state_peak_is_paper_value(B, S, F):
    """B sequences of length S, M = B*F/S every F steps: steady-state peak B*(S+F)/2
    exactly, batch B; FCFS peaks at B*S. (W_lim derived: B*(S+F)/2 + S, not binding.)"""
    assert (B * F) % S == 0 and S % F == 0
    reqs = uniform(20 * B, S)
    sched = SLSScheduler(B, 10**6, F)
    run = simulate(sched, reqs, 100 * S)
    assert sched.micro_batch_size() == B * F // S
    assert sched.w_lim() == B * (S + F) // 2 + S == paper_w_max(B, S, F) + S   # one sequence of headroom
    warm = 2 * S
    steady = run.loads[warm: len(run.loads) - 2 * S]
    assert max(steady) == B * (S + F) // 2
    assert max(run.loads) == B * (S + F) // 2
    assert set(run.batch[warm: len(run.batch) - 2 * S]) == {B}
    gaps = {b - a for a, b in zip(run.admit_steps, run.admit_steps[1:])}
    assert gaps == {F}

    fcfs = simulate(FCFSScheduler(B, 10**6), uniform(20 * B, S), 100 * S)
    assert max(fcfs.loads) == B * S
    # Same work done: every request ran, tokens per step the same in steady state.
    assert sum(run.batch) == sum(fcfs.batch) == 20 * B * S
    assert len(run.loads) <= len(fcfs.loads) + S


@FAST
@given(B=st.integers(1, 40), k=st.integers(1, 8), F=st.integers(1, 8))
def test_uniform_peak_with_explicit_w_lim(B, k, F):
    """Paper setting with W_lim given, batch size unbounded: the micro-batch cap M and
    W_lim alone produce the B*(S+F)/2 staircase."""
    S = k * F
    M = B * F // S
    if M * S != B * F or M == 0:
        return
    w_lim = B * (S + F) // 2
    sched = SLSScheduler(10**6, 10**6, F, w_lim=w_lim, micro_batch=M)
    run = simulate(sched, uniform(M * (S // F) * 6, S), 10_000)
    assert max(run.loads) == w_lim


def paper_earliest_step(batches, m, t, w_lim):
    """Algorithm 1's EARLIEST_STEP, literally, with E = the last step of a micro-batch
    (a sequence counts 1 at its first step and S at its last, E = start + S - 1)."""
    r = t
    for _, e, w in batches:
        if e < t:
            continue
        x = (w_lim - w) // m
        r = max(r, e - x + 1)
    return r


@FAST
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=12), S=st.integers(2, 30),
       gap=st.integers(1, 5), slack=st.integers(0, 60), m=st.integers(1, 6))
def test_earliest_step_matches_algorithm1(sizes, S, gap, slack, m):
    """Uniform micro-batches, each added at its earliest step (ADD_MICRO_BATCH): the
    LoadPlan's EARLIEST_STEP equals the paper's, and its W[i] bookkeeping.
    (Starts are strictly increasing: Algorithm 1's W.append(m*S) ignores a
    micro-batch that started at the same step.)"""
    w_lim = S * max(max(sizes), m) + slack
    plan = LoadPlan()
    batches = []          # paper's lists, zipped: (M, E, W)
    t, rid = 0, 0
    for size in sizes:
        cands = [Candidate(rid + i, 0, S) for i in range(size)]
        r = plan.earliest_step(t, cands, w_lim)
        assert r == paper_earliest_step(batches, size, t, w_lim)
        # ADD_MICRO_BATCH(size, r), the paper's way
        for i, (mi, e, w) in enumerate(batches):
            if e >= r:
                batches[i] = (mi, e, w + size * (e - r + 1))
        batches.append((size, r + S - 1, size * S))
        plan.add(r, cands)
        rid += size
        t = r + gap
        for mi, e, w in batches:
            if e >= t:
                assert plan.load_at(e) == w
        assert plan.peak(t) <= w_lim
    cands = [Candidate(rid + i, 0, S) for i in range(m)]
    assert plan.earliest_step(t, cands, w_lim) == paper_earliest_step(batches, m, t, w_lim)


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


def test_paper_w_max():
    assert paper_w_max(1024, 1024, 8) == 1024 * 1032 // 2
    assert paper_w_max(3, 4, 1) == 8          # ceil(7.5)
    assert paper_w_max(8, 40, 4, prompt_len=8) == 8 * 52 // 2


@pytest.mark.parametrize("B,P,G,F", [(16, 8, 32, 4), (12, 5, 24, 6), (32, 30, 64, 8)])
def test_prompts_steady_state_peak_and_full_batch(B, P, G, F):
    """With prompts the steady peak is B*(S+P+F)/2 (S = P+G) exactly, batch B."""
    reqs = [Req(0, P, G, G) for _ in range(12 * B)]
    sched = SLSScheduler(B, 10**6, F)
    run = simulate(sched, reqs, 100 * G)
    assert sched.w_lim() == paper_w_max(B, P + G, F, P) + P + G
    steady = slice(2 * G, len(run.loads) - 2 * G)
    assert set(run.batch[steady]) == {B}
    assert max(run.loads) == max(run.loads[steady]) == paper_w_max(B, P + G, F, P)


@pytest.mark.parametrize("B,P,G,F", [(64, 32, 768, 16), (64, 0, 768, 16), (48, 10, 100, 7), (30, 5, 77, 5)])
def test_fractional_micro_batches_keep_the_batch_full(B, P, G, F):
    """B*F/S fractional (4/3, 3.36, ...): sizes alternate (1, 1, 2, ...); the batch stays
    near B and the load under the derived W_lim. (When S is not a multiple of F a slot
    freed between two admission steps idles until the next, at most F-1 of every G+F-1 steps.)"""
    sched = SLSScheduler(B, 10**6, F)
    run = simulate(sched, [Req(0, P, G, G) for _ in range(8 * B)], 100_000)
    steady = slice(3 * G, 5 * G)
    assert sum(run.batch[steady]) / len(run.batch[steady]) >= (1 - (F - 1) / (G + F - 1)) * B
    assert max(run.batch) <= B and max(run.loads) <= sched.w_lim()


@FAST
@given(inflight=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 20), st.integers(1, 40)), max_size=25),
       extra=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 40)), min_size=1, max_size=5),
       now=st.integers(0, 40), w_lim=st.integers(1, 400))
def test_earliest_step_is_first_fitting_step(inflight, extra, now, w_lim):
    """Mixed lengths: EARLIEST_STEP equals a scan of every start step, and peak()
    equals the step-by-step maximum of the summed load curves."""
    plan = LoadPlan()
    inflight = [(min(start, now), p, g) for start, p, g in inflight]   # started by `now`
    for i, (start, prompt, max_tokens) in enumerate(inflight):
        if start + max_tokens - 1 >= now:          # still in flight at `now`
            plan.add(start, [Candidate(i, prompt, max_tokens)])
    cands = [Candidate(1000 + i, p, g) for i, (p, g) in enumerate(extra)]

    def direct_peak(r):
        old = {i: (s, p, g) for i, (s, p, g) in enumerate(inflight) if i in plan}
        return max(sum(p + 1 + t - s for s, p, g in old.values() if s <= t <= s + g - 1)
                   + sum(p + 1 + t - r for p, g in extra if t <= r + g - 1) for t in range(r, r + 80))

    last = max([s + g for s, _, g in inflight] + [now])
    brute = next((r for r in range(now, last + 1) if direct_peak(r) <= w_lim), None)
    assert plan.earliest_step(now, cands, w_lim) == brute
    assert plan.earliest_step(now, cands[:1], w_lim) == next(
        (r for r in range(now, last + 1) if plan.peak(r, cands[:1]) <= w_lim), None)
    for r in (now, now + 3, last):
        assert plan.peak(r, cands) == direct_peak(r)


def test_greedy_admission_without_micro_batches_synchronises():
    """Why SLS caps micro-batches at ~B*F/S: admitting every prefix that fits W_lim falls
    into cohorts of about W_lim/S that start and end together (FCFS-like, below B)."""
    B, S, F = 64, 64, 8
    greedy = SLSScheduler(B, 10**6, F, w_lim=B * (S + F) // 2, micro_batch=10**6)
    run = simulate(greedy, uniform(10 * B, S), 100 * S)
    assert max(run.batch[4 * S: 8 * S]) < 0.6 * B
    paced = simulate(SLSScheduler(B, 10**6, F, w_lim=B * (S + F) // 2), uniform(10 * B, S), 100 * S)
    assert set(paced.batch[2 * S: 8 * S]) == {B}
