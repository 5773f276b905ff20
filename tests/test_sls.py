"""SLS admission (fastdecode/scheduler/sls.py) driven by a simulated engine.

The simulated engine follows the scheduler's convention: a request admitted at
step a with prompt p holds p + (t - a) + 1 tokens of context at step t and
finishes after `actual` generated tokens (<= max_tokens: early stops).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
