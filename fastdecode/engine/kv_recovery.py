"""What the engine does when the backend has no KV for a sequence, or has lost it.

Admission opens KV for as long a prefix of the admitted as the backend takes (halving it
on each capacity refusal); the rest wait, and admission backs off (KVBackoff). Before a
decode step the youngest running sequences the store cannot grow are preempted (KVPlan);
rows the backend refuses in the step are preempted too, unless one runs alone: it ends.
Sequences whose KV was lost get fresh KV and are prefilled again with the admitted ones,
a few times at most. Any other failure ends the sequences concerned, never the engine.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from fastdecode.attention import AttentionError, KVCapacityError
from fastdecode.engine.model_runner import ModelRunner
from fastdecode.engine.preemption import TOO_LONG, KVBackoff, KVPlan
from fastdecode.engine.requests import RequestTable
from fastdecode.engine.sequence import Sequence, Status
from fastdecode.scheduler import Scheduler

log = logging.getLogger("fastdecode.engine")
MAX_REBUILD_ATTEMPTS = 3     # re-prefills of a sequence whose KV keeps getting lost in one step


class KVRecovery:
    def __init__(self, runner: ModelRunner, requests: RequestTable, plan: KVPlan, scheduler: Scheduler,
                 step: Callable[[], int], finish: Callable[..., None]) -> None:
        self.runner = runner
        self.requests = requests
        self.plan = plan
        self.backoff = KVBackoff()
        self.scheduler = scheduler
        self.step = step            # the engine's step number now
        self.finish = finish        # finish(seq, reason, error): end a request and tell its caller

    def admission_due(self) -> bool:
        return self.backoff.due(bool(self.requests.running))

    def admissible(self, head: list[Sequence]) -> int:
        """How many of `head` (in order) the KV store has room for now."""
        n = len(head)
        return min(n, self.plan.admissible(head, self.requests.running), self.backoff.limit() or n)

    def open(self, chosen: list[Sequence]) -> int:
        """Open KV for the longest prefix of `chosen` the backend has room for now (halving the
        prefix on each capacity refusal; the backend's open is all or nothing); returns its
        length. Refused requests stay waiting and are retried later. Any other failure ends
        the requests with an error."""
        k, refusal = len(chosen), None
        while k > 0:
            ids = [s.seq_id for s in chosen[:k]]
            try:
                self.runner.backend.open(ids)
            except KVCapacityError as e:
                refusal, k = e, k // 2
                continue
            except Exception as e:  # noqa: BLE001 -- a failed open must not take every request down
                if isinstance(e, AttentionError):
                    message = f"attention backend failure: {e}"
                else:
                    log.exception("opening KV for %d sequence(s) failed", len(ids))
                    message = f"opening KV failed: {type(e).__name__}: {e}"
                    self.close(chosen[:k])          # whatever it left open (close is idempotent)
                for s in chosen[:k]:
                    self.finish(s, "error", message)
                return 0
            self.backoff.accepted()
            return k
        self.backoff.refused(refusal, len(self.requests.waiting))
        return 0

    def prefill(self, admitted: list[Sequence], lost: list[Sequence]) -> tuple[list[Sequence], list[torch.Tensor]]:
        """Prefill the admitted, and the lost (on fresh KV) to rebuild their KV; again for those
        whose KV is lost in the prefill, a few times at most. Returns the sequences to sample
        and their logits (in parts, a row each)."""
        seqs: list[Sequence] = []
        logits: list[torch.Tensor] = []
        prefill, rebuild = admitted, lost
        for attempt in range(MAX_REBUILD_ATTEMPTS + 1):
            rebuild = self.reopen(rebuild, last_try=attempt == MAX_REBUILD_ATTEMPTS)
            batch = prefill + rebuild
            if not batch:
                break
            refused: list[int] = []
            prompt_logprobs = {s.seq_id: s.params.prompt_logprobs for s in batch if wants_prompt_logprobs(s)}
            try:
                out, lost_ids = self.runner.prefill([s.seq_id for s in batch], [s.all_ids for s in batch], refused,
                                                    prompt_logprobs)
            except AttentionError as e:
                if isinstance(e, KVCapacityError):
                    self.refused(batch, f"during prefill: {e}")
                else:
                    for s in batch:
                        self.finish(s, "error", f"attention backend failure during prefill: {e}")
                break
            self.refused([s for s in batch if s.seq_id in refused], "during prefill")
            lost_set = set(lost_ids)
            keep = [i for i, s in enumerate(batch) if s.seq_id not in lost_set and s.status is Status.RUNNING]
            seqs += [batch[i] for i in keep]
            logits.append(out[keep])
            for i in keep:
                if isinstance(prompt_logprobs.get(batch[i].seq_id), list):
                    batch[i].prompt_logprobs = prompt_logprobs[batch[i].seq_id]
            prefill, rebuild = [], [s for s in batch if s.seq_id in lost_set]
        return seqs, logits

    def reopen(self, seqs: list[Sequence], last_try: bool) -> list[Sequence]:
        """Fresh KV for sequences whose KV was lost; those that cannot get one end with an error."""
        if not seqs:
            return []
        ids = [s.seq_id for s in seqs]
        reason = "KV lost repeatedly" if last_try else None
        if reason is None:
            try:
                self.runner.backend.close(ids)
                self.runner.backend.open(ids)
                return seqs
            except AttentionError as e:
                reason = f"KV lost and could not be rebuilt: {e}"
        for s in seqs:
            self.finish(s, "error", f"attention backend failure: {reason}")
        return []

    def free(self, s: Sequence) -> None:
        """A running sequence is done: its KV goes back, and admission may ask for KV again."""
        self.close([s])
        self.backoff.frees += 1

    def close(self, seqs: list[Sequence]) -> None:
        try:
            self.runner.backend.close([s.seq_id for s in seqs])
        except Exception:            # freeing must not take the engine down
            log.exception("closing KV of sequence(s) %s failed", [s.seq_id for s in seqs][:8])

    def make_room(self) -> None:
        """Before a decode step: preempt the youngest running sequences the KV store cannot grow."""
        doomed, victims = self.plan.victims(self.requests.running)
        for s in doomed:
            self.finish(s, "error", TOO_LONG)
        self.preempt(victims)

    def refused(self, seqs: list[Sequence], when: str) -> None:
        """The backend had no KV for these running sequences in the step: preempt them (and pause
        admission until KV is freed), unless one is all that runs: it ends with an error."""
        if len(self.requests.running) == 1 and seqs:
            self.finish(seqs[0], "error", f"out of KV capacity {when}")
        elif seqs:
            self.preempt(seqs)
            self.backoff.refused(f"KV refused {when}", len(self.requests.waiting), cap=max(1, len(seqs) // 2))

    def preempt(self, seqs: list[Sequence]) -> None:
        """Free these running sequences' KV; they wait first in line, to be recomputed (preemption.py)."""
        if not seqs:
            return
        self.close(seqs)
        self.requests.requeue_first(seqs)
        step = self.step()
        for s in seqs:
            self.scheduler.on_preempted(step, s.seq_id)
        self.plan.preemptions += len(seqs)
        log.info("preempted %d sequence(s) for lack of KV; %d run on", len(seqs), len(self.requests.running))


def wants_prompt_logprobs(s: Sequence) -> bool:
    """Asked for, and not yet computed: a sequence prefilled again (lost KV, preempted) has them."""
    return s.params.prompt_logprobs is not None and not s.output_ids and s.prompt_logprobs is None
