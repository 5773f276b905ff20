"""Sampling parameters (vLLM-style) and the batched sampler.

One sampler call per step samples every running sequence: greedy rows take an
argmax, the others are filtered (top-k, top-p), scaled by temperature and
sampled by inverting their cumulative distribution at one uniform draw per row
(the first token whose cumulative probability exceeds u * total): multinomial
sampling, at one random number a row instead of one per vocabulary entry.
A request with a seed owns a torch.Generator, so its tokens do not depend on
what else is in the batch. A seeded row's draw is made on its generator's
device (the CPU generator of Sequence) and moved to the logits' device: torch
refuses a CPU generator for a CUDA tensor, and this way a seed gives the same
tokens on every device the logits may live on.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from fastdecode.engine.errors import InvalidRequestError
from fastdecode.model import fused


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0           # 0 = greedy
    top_p: float = 1.0                 # in (0, 1]
    top_k: int = 0                     # 0 or -1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()         # a str or list is accepted and stored as a tuple
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise InvalidRequestError(msg)

        # accept what JSON gives: a single stop string, lists, nulls
        stop, ids = self.stop, self.stop_token_ids
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        check(isinstance(stop, (list, tuple)), f"stop must be a string or a list of strings, got {type(stop).__name__}")
        ids = () if ids is None else ids
        check(isinstance(ids, (list, tuple)), f"stop_token_ids must be a list of integers, got {type(ids).__name__}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.top_k is None:
            object.__setattr__(self, "top_k", 0)

        check(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(_is_num(self.temperature) and self.temperature >= 0 and self.temperature == self.temperature
              and self.temperature != float("inf"), f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (0, -1)),
              f"top_k must be an integer >= 1, or 0 / -1 for off, got {self.top_k!r}")
        check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), f"seed must be a non-negative integer, got {self.seed!r}")
        check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
              f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        check(isinstance(self.stop_token_ids, tuple) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        check(isinstance(self.ignore_eos, bool), f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """From vLLM-style JSON keys; unknown keys and bad values raise InvalidRequestError."""
        if not isinstance(d, dict):
            raise InvalidRequestError(f"sampling parameters must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf.
    logits [B, V] float32 (already temperature-scaled); top_k [B] (0 = off); top_p [B]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device)
    remove = ranks[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs          # keep a token while the mass before it is < p
    remove = remove | (mass_before >= top_p[:, None])
    remove[:, 0] = False                                  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def seeded_uniform(generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """One U[0, 1) draw from `generator`, on `device`. Drawn where the generator lives
    (a CPU generator cannot fill a CUDA tensor), then moved: the same number whatever `device` is."""
    return torch.rand(1, generator=generator, device=generator.device).to(device)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] (any float dtype; sampled rows are upcast to float32) -> token ids [B] (int64)."""
    tokens = fused.argmax(logits)             # first of equal maxima
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    idx = torch.tensor(rows, device=logits.device)
    temperatures = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
    u = _uniforms(rows, generators, logits.device)
    filtered = any(params[i].top_k > 0 or params[i].top_p < 1 for i in rows)
    if not filtered and fused.can_sample(logits):
        tokens[idx] = fused.sample_rows(logits, idx, temperatures, u)
        return tokens
    x = logits.index_select(0, idx).float().div_(temperatures.to(logits.device)[:, None])
    if filtered:
        top_k = torch.tensor([max(params[i].top_k, 0) for i in rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device, dtype=torch.float32)
        x = filter_logits(x, top_k, top_p)
    cdf = x.softmax(dim=-1).cumsum_(dim=-1)
    # a token of zero probability repeats its predecessor's sum: `right` never lands on it
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    tokens[idx] = chosen.clamp_(max=cdf.shape[1] - 1)
    return tokens


def _uniforms(rows: list[int], generators: list[torch.Generator | None], device) -> torch.Tensor:
    """One U[0, 1) draw per sampled row: seeded rows from their own generator."""
    u = torch.empty(len(rows), device=device)
    shared = [j for j, i in enumerate(rows) if generators[i] is None]
    if shared:
        u[shared] = torch.rand(len(shared), device=device)
    for j, i in enumerate(rows):
        if generators[i] is not None:
            u[j] = seeded_uniform(generators[i], device)
    return u
