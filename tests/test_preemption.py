"""Recompute preemption when KV runs out (fastdecode/engine/preemption.py): the youngest
sequences are preempted and recomputed, streams never repeat or drop a token, greedy output
is unchanged, and only the sequences that cannot get KV are touched."""
from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from fastdecode.attention.base import KVCapacityError, KVRoom
from fastdecode.attention.torch_ref import TorchAttention
from fastdecode.config import EngineConfig
from fastdecode.engine import Engine, InvalidRequestError, SamplingParams
from fastdecode.engine.preemption import KVPlan, decode_fit

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "Hello, world!", "def f(x):", "FastDecode splits", "numbers 0123"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def pages(n: int, page: int) -> int:
    return -(-n // page)


class PagedTorch(TorchAttention):
    """The reference backend with KV pools of `pool` pages of `page` tokens, one per worker
    (a sequence's worker: its id modulo `workers`). counting=True: like the local backend it
    tells its free KV (kv_room) and refuses a whole call without room; counting=False: like
    R-workers it cannot tell, and a call refuses the rows of the workers without room
    (KVCapacityError naming them, with the others' output)."""

    def __init__(self, spec, page: int, pool: int, counting: bool = True, workers: int = 1) -> None:
        super().__init__(spec)
        self.page, self.pool, self.counting, self.workers = page, pool, counting, workers
        self.refusals = 0
        self.refusing: set[int] = set()    # workers that refuse every call (a test sets it)

    def used(self, worker: int | None = None) -> int:
        return sum(pages(t[0].shape[0], self.page) for s, t in self.k.items()
                   if worker is None or s % self.workers == worker)

    def kv_room(self):
        if not self.counting:
            return None
        return KVRoom(self.page, self.pool - self.used(), self.pool)

    def _refused(self, seq_ids, adds) -> list[int]:
        """Ids on workers that cannot take `adds` more tokens for each of seq_ids."""
        need = {}
        for s, n in zip(seq_ids, adds):
            have = self.k[s][0].shape[0]
            w = s % self.workers
            need[w] = need.get(w, 0) + pages(have + n, self.page) - pages(have, self.page)
        full = {w for w, n in need.items() if n > self.pool - self.used(w)} | self.refusing
        return [s for s in seq_ids if s % self.workers in full]

    def prefill(self, layer, seq_ids, lens, k, v) -> None:
        refused = self._refused(seq_ids, lens) if layer == 0 else []
        if refused:
            self.refusals += 1
            raise KVCapacityError("pool full (prefill)", None if self.counting else refused)
        super().prefill(layer, seq_ids, lens, k, v)

    def submit_decode(self, layer, seq_ids, q, k, v):
        refused = set(self._refused(seq_ids, [1] * len(seq_ids))) if layer == 0 else set()
        if not refused:
            return super().submit_decode(layer, seq_ids, q, k, v)
        self.refusals += 1
        fut: Future = Future()
        if self.counting:
            fut.set_exception(KVCapacityError("pool full (decode)"))
            return fut
        keep = [i for i, s in enumerate(seq_ids) if s not in refused]
        out = torch.zeros(q.shape, dtype=torch.float32)
        if keep:
            idx = torch.tensor(keep)
            out[idx] = super().submit_decode(layer, [seq_ids[i] for i in keep], q[idx], k[idx], v[idx]).result()
        fut.set_exception(KVCapacityError("pool full (decode)", sorted(refused), out))
        return fut


def torch_engine(model_dir: str, backend_factory=None, **kw) -> Engine:
    # float32: a recomputed sequence's prefill and the clean run's decode steps agree to the bit
    engine = Engine(EngineConfig(model=model_dir, attention="torch", dtype="float32", **kw))
    if backend_factory is not None:
        engine.backend = engine.runner.backend = backend_factory(engine.spec)
    return engine


def run(engine: Engine, prompts=PROMPTS, params=GREEDY, timeout: float = 120.0):
    """Every request's streamed outputs, by request id, in order of arrival."""
    streams: dict[str, list] = {}
    ids = [engine.add_request(p, params, on_output=lambda o: streams.setdefault(o.request_id, []).append(o))
           for p in prompts]
    deadline = time.monotonic() + timeout
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "generation did not finish in time"
        engine.step()
    return [streams[i] for i in ids]


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def check_stream(outs, engine: Engine) -> None:
    """One continuous stream: counts rise by the tokens of each record, one final record, the text
    is the tokens' text (nothing repeated, nothing dropped)."""
    count = 0
    for o in outs:
        count += len(o.token_ids)
        assert o.num_output_tokens == count
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(tokens(outs), skip_special_tokens=True)


@pytest.fixture(scope="module")
def clean(tiny_model_dir):
    engine = torch_engine(tiny_model_dir)
    try:
        return [tokens(o) for o in run(engine)]
    finally:
        engine.stop()


def test_kv_running_out_preempts_youngest_and_output_is_unchanged(tiny_model_dir, clean):
    # pages of 4 tokens; 5 sequences of up to ~25 tokens would need ~35 pages
    engine = torch_engine(tiny_model_dir, lambda spec: PagedTorch(spec, page=4, pool=22))
    try:
        outs = run(engine)
        assert [o[-1].finish_reason for o in outs] == ["length"] * len(PROMPTS)
        assert [tokens(o) for o in outs] == clean
        for o in outs:
            check_stream(o, engine)
        st = engine.stats()
        assert st["preemptions"] > 0 and engine.backend.refusals == 0     # planned: no call refused
        assert engine.backend.stats()["sequences"] == 0 and not engine.requests.waiting and engine.healthy
    finally:
        engine.stop()


def test_preemption_frees_the_youngest_and_queues_them_first(tiny_model_dir):
    engine = torch_engine(tiny_model_dir, lambda spec: PagedTorch(spec, page=4, pool=14), max_running=4)
    try:
        for p in PROMPTS[:4]:
            engine.add_request(p, GREEDY)
        engine.step()
        late = engine.add_request("a later request", GREEDY)        # waits: max_running are running
        deadline = time.monotonic() + 60
        while engine.stats()["preemptions"] == 0:
            assert time.monotonic() < deadline and engine.requests.by_id[late] in engine.requests.waiting
            engine.step()
        running = [s.seq_id for s in engine.requests.running]
        waiting = list(engine.requests.waiting)
        preempted, last = waiting[:-1], waiting[-1]
        assert last.request_id == late and preempted                 # the preempted go first in line
        assert all(s.output_ids for s in preempted)                  # ... with the tokens they streamed
        assert [s.seq_id for s in preempted] == sorted(s.seq_id for s in preempted)   # oldest first
        assert min(s.seq_id for s in preempted) > max(running)       # the youngest went
        assert engine.stats()["preemptions"] == len(preempted) and engine.backend.refusals == 0
        while engine.has_unfinished():
            engine.step()
        assert engine.backend.stats()["sequences"] == 0
    finally:
        engine.stop()


def test_a_refusing_worker_preempts_only_its_own_sequences(tiny_model_dir, clean):
    """The remote case: the backend cannot tell its room and refuses in the step; only the
    refusing worker's rows are preempted, the other worker's sequences run on untouched."""
    engine = torch_engine(tiny_model_dir, lambda spec: PagedTorch(spec, page=4, pool=12, counting=False, workers=2))
    preempted: set[int] = set()
    real = engine.kv_recovery.preempt

    def spy(seqs):
        preempted.update(s.seq_id for s in seqs)
        real(seqs)
    engine.kv_recovery.preempt = spy
    try:
        outs = run(engine)
        assert [o[-1].finish_reason for o in outs] == ["length"] * len(PROMPTS)
        assert [tokens(o) for o in outs] == clean
        for o in outs:
            check_stream(o, engine)
        assert engine.backend.refusals > 0 and preempted
        assert engine.stats()["preemptions"] >= len(preempted)
        assert engine.backend.stats()["sequences"] == 0 and engine.healthy
    finally:
        engine.stop()


def test_one_workers_refusal_in_a_step_spares_the_other_worker(tiny_model_dir):
    engine = torch_engine(tiny_model_dir, lambda spec: PagedTorch(spec, page=4, pool=10 ** 6, counting=False,
                                                                  workers=2))
    try:
        for p in PROMPTS[:4]:
            engine.add_request(p, GREEDY)
        engine.step()
        engine.step()
        engine.backend.refusing = {1}                       # worker 1 is full now; worker 0 is not
        engine.step()
        running = sorted(s.seq_id for s in engine.requests.running)
        waiting = sorted(s.seq_id for s in engine.requests.waiting)
        assert running == [2, 4] and waiting == [1, 3]       # ids 1, 3 live on worker 1
        assert engine.stats()["preemptions"] == 2
        engine.backend.refusing = set()
        assert all(o.finish_reason is None for o in engine.step())
    finally:
        engine.stop()


def test_local_backend_preempts_and_output_is_unchanged(tiny_model_dir):
    from rpart.kernels import KVStore

    kw = dict(attention="local", kernel_threads=1, kv_block_size=4, dtype="float32")
    ref = Engine(EngineConfig(model=tiny_model_dir, kv_capacity_bytes=16 << 20, **kw))
    try:
        want = [tokens(o) for o in run(ref)]
    finally:
        ref.stop()
    spec = ref.spec
    block = KVStore(spec.num_layers, spec.num_kv_heads, spec.head_dim, 1 << 20, block_size=4).block_bytes
    engine = Engine(EngineConfig(model=tiny_model_dir, kv_capacity_bytes=22 * spec.num_layers * block, **kw))
    try:
        assert engine.backend.kv_room().total_pages == 22
        outs = run(engine)
        assert [o[-1].finish_reason for o in outs] == ["length"] * len(PROMPTS)
        assert [tokens(o) for o in outs] == want
        for o in outs:
            check_stream(o, engine)
        assert engine.stats()["preemptions"] > 0
        assert engine.backend.stats()["sequences"] == 0 and engine.backend.stats()["blocks_used"] == 0
    finally:
        engine.stop()


def test_prompt_that_cannot_fit_the_whole_store_is_refused(tiny_model_dir):
    engine = torch_engine(tiny_model_dir, lambda spec: PagedTorch(spec, page=4, pool=3))
    try:
        with pytest.raises(InvalidRequestError, match="KV"):
            engine.add_request(list(range(3, 15)), GREEDY)          # 12 tokens + 1 > 3 pages of 4
        outs = run(engine, ["hi"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert outs[0][-1].finish_reason == "length" and engine.healthy
    finally:
        engine.stop()


def test_a_sequence_outgrowing_the_whole_store_ends_with_an_error(tiny_model_dir):
    engine = torch_engine(tiny_model_dir, lambda spec: PagedTorch(spec, page=4, pool=4))
    try:
        outs = run(engine, ["The quick brown fox"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        final = outs[0][-1]
        assert final.finish_reason == "error" and "KV" in final.error
        assert 0 < final.num_output_tokens < 40
        check_stream(outs[0], engine)
        assert engine.backend.stats()["sequences"] == 0 and engine.healthy
        outs = run(engine, ["hi"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert outs[0][-1].finish_reason == "length"
    finally:
        engine.stop()


def test_admission_keeps_a_watermark_free(tiny_model_dir):
    engine = torch_engine(tiny_model_dir, lambda spec: PagedTorch(spec, page=4, pool=8))
    try:
        a = engine.add_request(list(range(3, 14)), GREEDY)          # 11 tokens: 3 pages, 4 with its growth
        engine.step()
        b = engine.add_request(list(range(3, 15)), GREEDY)          # 12 + 1 tokens: 4 pages
        engine.step()               # 5 free - 1 (a's next token, bounded) - 1 (watermark) < 4: b waits
        assert [s.request_id for s in engine.requests.running] == [a]
        assert engine.requests.by_id[b] in engine.requests.waiting
        assert engine.stats()["preemptions"] == 0
    finally:
        engine.stop()


def seqs(*lengths):
    """Fake running sequences, oldest first: KV lengths as given (num_tokens one more)."""
    return [SimpleNamespace(seq_id=i + 1, num_tokens=n + 1) for i, n in enumerate(lengths)]


def test_decode_fit_and_victims():
    room = KVRoom(page_tokens=4, free_pages=1, total_pages=10)
    assert decode_fit(room, [8, 5, 4]) == 2          # 8 and 4 need a page each; freeing the youngest (1) does it
    assert decode_fit(room, [5, 6, 7]) == 3          # none needs a page
    assert decode_fit(KVRoom(4, 0, 2), [8]) == 0     # it holds all and needs another
    plan = KVPlan(lambda: room)
    doomed, victims = plan.victims(seqs(8, 5, 4))
    assert doomed == [] and [s.seq_id for s in victims] == [3]
    plan = KVPlan(lambda: KVRoom(4, 5, 10))
    assert plan.victims(seqs(8, 5, 4)) == ([], [])   # room for all: nothing walked


def test_admissible_counts_growth_and_watermark():
    plan = KVPlan(lambda: KVRoom(4, 5, 100))
    running = seqs(8)                                # needs a page at the next step
    waiting = seqs(6, 3)                              # 7 + 1 tokens: 2 pages; 4 + 1: 2 pages
    assert plan.admissible(waiting, running) == 1    # 5 - 1 growth - 1 watermark - 2 = 1 < 2 more
    assert plan.admissible(waiting, []) == 2         # nothing runs: no watermark, no growth
    assert KVPlan(lambda: None).admissible(waiting, running) == 2


def test_remote_worker_refusal_preempts_only_its_sequences(tiny_model_dir, tmp_path):
    """Real R-workers: one refuses a decode call (RESOURCE_EXHAUSTED); only the sequences it
    holds are preempted and recomputed, the other worker's run on, and output is unchanged."""
    import grpc

    from rpart.proto import rworker_pb2 as pb
    from fastdecode.ops.testing import local_fleet

    kw = dict(model=tiny_model_dir, dtype="float32", max_running=8)
    ref = Engine(EngineConfig(attention="local", kernel_threads=1, kv_capacity_bytes=16 << 20, **kw))
    try:
        want = [tokens(o) for o in run(ref)]
    finally:
        ref.stop()
    with local_fleet(2, tmp_path, kv_capacity="16M") as fleet:
        engine = Engine(EngineConfig(attention="remote", rworkers=fleet.addresses, **kw))
        backend, state, preempted = engine.backend, {"decode": False, "calls": 0, "held": None}, set()
        submit, send, preempt = backend.submit_decode, backend.workers[0].send_bytes, engine.kv_recovery.preempt

        def submit_decode(*args):
            state["decode"] = True
            try:
                return submit(*args)
            finally:
                state["decode"] = False

        def send_bytes(call_id, data, configuring=False):
            if state["decode"]:
                state["calls"] += 1
                if state["calls"] == 7:                 # mid-generation, at layer 0 of a step
                    state["held"] = {s for s, g in backend.placement.items() if g is backend.groups[0]}
                    fut: Future = Future()
                    fut.set_result(pb.Reply(call_id=call_id, code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                            message="out of KV capacity (test)"))
                    return fut
            return send(call_id, data, configuring)

        def spy(seqs):
            preempted.update(s.seq_id for s in seqs)
            preempt(seqs)
        backend.submit_decode, backend.workers[0].send_bytes = submit_decode, send_bytes
        engine.kv_recovery.preempt = spy
        try:
            outs = run(engine)
            assert [o[-1].finish_reason for o in outs] == ["length"] * len(PROMPTS)
            assert [tokens(o) for o in outs] == want
            for o in outs:
                check_stream(o, engine)
            held = state["held"]
            assert held and len(held) < len(PROMPTS) and preempted == held
            assert engine.stats()["preemptions"] == len(held)
            assert engine.backend.stats()["sequences"] == 0 and engine.healthy
        finally:
            engine.stop()
