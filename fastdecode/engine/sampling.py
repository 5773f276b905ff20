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

vLLM's other common parameters change the logits of the rows that ask for them, in vLLM's order:
min_tokens masks the stop tokens (EOS unless ignore_eos, and stop_token_ids) while fewer tokens
were generated; logit_bias adds its value to its tokens' logits; repetition_penalty divides a
positive logit (multiplies a negative one) of every token seen in the prompt or the output;
frequency_penalty and presence_penalty subtract f * count + p * (count > 0) over the output's
tokens; then temperature; then min_p drops tokens whose probability is below min_p times the
largest; then top-k and top-p. A greedy row takes the argmax of its penalized logits. Only those
rows take that path, on a copy of their logits (their token history, kept by Sequence, gives the
counts; the penalties touch only the tokens seen); where the logits are bf16 or fp32 on the CPU,
the penalized copy keeps their dtype (a bf16 logit rounded once) and the fused kernels sample it,
min_p as a cut at max(x) + T * ln(min_p), unless top-k or top-p ask for the float32 path. A batch
where no row asks for any of this samples as before, at the cost of one scan of the rows' flags.
Logprobs (token_logprobs) are those of the raw logits.
"""
from __future__ import annotations

import math
from array import array
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
    repetition_penalty: float = 1.0    # > 0, 1 = off
    frequency_penalty: float = 0.0     # in [-2, 2]
    presence_penalty: float = 0.0      # in [-2, 2]
    min_p: float = 0.0                 # in [0, 1]
    min_tokens: int = 0                # stop tokens and stop strings ignored before this many tokens
    logprobs: int | None = None        # 0..MAX_LOGPROBS: the sampled token's logprob and this many top ones
    prompt_logprobs: int | None = None  # 0..MAX_LOGPROBS: each prompt token's logprob and this many top ones
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit); a {id: bias} dict is accepted

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
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name, off in (("top_k", 0), ("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                          ("presence_penalty", 0.0), ("min_p", 0.0), ("min_tokens", 0)):
            if getattr(self, name) is None:          # JSON null = the default
                object.__setattr__(self, name, off)

        check(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(_is_num(self.temperature) and self.temperature >= 0 and self.temperature == self.temperature
              and self.temperature != float("inf"), f"temperature must be a finite number >= 0, got {self.temperature!r}")
        # the sampler divides in float32: a temperature that rounds to 0 or inf there would fail the whole step
        check(self.temperature == 0 or FLOAT32_MIN_NORMAL <= self.temperature <= FLOAT32_MAX,
              f"temperature must be 0 (greedy) or in [{FLOAT32_MIN_NORMAL:.3g}, {FLOAT32_MAX:.3g}] (float32), "
              f"got {self.temperature!r}")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (0, -1)) and self.top_k < 2**63,
              f"top_k must be an integer >= 1 (below 2**63: the sampler holds it in int64), or 0 / -1 for off, "
              f"got {self.top_k!r}")
        check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), f"seed must be a non-negative integer, got {self.seed!r}")
        check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
              f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        check(isinstance(self.stop_token_ids, tuple) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        check(isinstance(self.ignore_eos, bool), f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        rp = self.repetition_penalty
        check(_is_num(rp) and _is_finite(rp) and rp > 0,
              f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            check(_is_num(v) and -2 <= v <= 2, f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1,
              f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0,
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.min_tokens <= self.max_tokens,
              f"min_tokens must be at most max_tokens, got min_tokens {self.min_tokens} > max_tokens {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
                  f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {v!r}")
        penalized = rp != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
        # flags the sampler scans every step (not dataclass fields: not parameters, not compared)
        object.__setattr__(self, "penalized", penalized)
        object.__setattr__(self, "needs_history", penalized or self.min_tokens > 0)
        object.__setattr__(self, "adjusts", penalized or self.min_tokens > 0 or self.min_p > 0 or bool(self.logit_bias))

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


MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024       # entries of one request's logit_bias
LOGIT_BIAS_LIMIT = 100.0    # OpenAI's range: -100 bans a token, +100 all but forces it
FLOAT32_MIN_NORMAL, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    """math.isfinite, False (not OverflowError) for an int beyond float's range."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """{token id (int, or its decimal string as JSON keys are): bias} or (id, bias) pairs -> sorted pairs."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in value):
        items = [tuple(x) for x in value]
    else:
        raise InvalidRequestError(f"logit_bias must be an object mapping token ids to numbers, got {value!r:.100}")
    if len(items) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias has {len(items)} entries, more than {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, bias in items:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() and len(key) < 20 else key
        if not _is_int(token) or not 0 <= token < 2**31:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {key!r:.40}")
        if not _is_num(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise InvalidRequestError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, "
                                      f"{LOGIT_BIAS_LIMIT:g}], got {bias!r:.40} for token {token}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


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


class TokenHistory:
    """A sequence's token ids (prompt, then output), kept for a request whose sampling needs them:
    an int64 array appended to per token, read by the sampler without a copy per token."""
    __slots__ = ("ids", "num_prompt")

    def __init__(self, prompt_ids, output_ids=()) -> None:
        self.ids = array("q", prompt_ids)
        self.ids.extend(output_ids)
        self.num_prompt = len(prompt_ids)

    def append(self, token: int) -> None:
        self.ids.append(token)

    @property
    def num_output(self) -> int:
        return len(self.ids) - self.num_prompt

    def tensor(self, start: int = 0) -> torch.Tensor:
        """ids[start:] as a new int64 tensor."""
        if len(self.ids) <= start:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(self.ids, dtype=torch.int64)[start:].clone()


@dataclass
class TokenLogprobs:
    """One token's log probability and the top-N (token id, log probability), best first. A prompt's
    first token has none (logprob None): nothing comes before it."""
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories=None, eos_token_ids=()) -> torch.Tensor:
    """logits [B, V] (any float dtype; sampled rows are upcast to float32) -> token ids [B] (int64).
    histories (a list, or a function returning it, called only when a row needs it): row i's
    TokenHistory where params[i].needs_history; eos_token_ids: what
    min_tokens masks besides stop_token_ids. `logits` is not modified."""
    if any(p.adjusts for p in params):
        return _sample_adjusted(logits, params, generators, histories, eos_token_ids)
    tokens = fused.argmax(logits)             # first of equal maxima
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        _sample_plain(tokens, logits, rows, params, generators)
    return tokens


def _sample_plain(tokens: torch.Tensor, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> None:
    """Sample `rows` (none greedy, none adjusted) into tokens[rows]."""
    idx = torch.tensor(rows, device=logits.device)
    temperatures = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
    u = _uniforms(rows, generators, logits.device)
    filtered = any(params[i].top_k > 0 or params[i].top_p < 1 for i in rows)
    if not filtered and fused.can_sample(logits):
        tokens[idx] = fused.sample_rows(logits, idx, temperatures, u)
        return
    x = logits.index_select(0, idx).float().div_(temperatures.to(logits.device)[:, None])
    tokens[idx] = _invert(x, [params[i] for i in rows], u, filtered)


def _invert(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, filtered: bool) -> torch.Tensor:
    """Rows of temperature-scaled float32 logits -> one token each drawn at u (top-k/top-p applied if filtered)."""
    if filtered:
        top_k = torch.tensor([max(p.top_k, 0) for p in params], device=x.device)
        top_p = torch.tensor([p.top_p for p in params], device=x.device, dtype=torch.float32)
        x = filter_logits(x, top_k, top_p)
    cdf = x.softmax(dim=-1).cumsum_(dim=-1)
    # a token of zero probability repeats its predecessor's sum: `right` never lands on it
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return chosen.clamp_(max=cdf.shape[1] - 1)


def _sample_adjusted(logits, params, generators, histories, eos_token_ids) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.adjusts]
    plain = [i for i, p in enumerate(params) if not p.adjusts and not p.greedy]
    if len(rows) + len(plain) < len(params):       # plain greedy rows
        tokens = fused.argmax(logits)
    else:
        tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    if plain:
        _sample_plain(tokens, logits, plain, params, generators)
    ps = [params[i] for i in rows]
    if callable(histories):
        histories = histories()
    hs = [histories[i] if histories is not None else None for i in rows]
    for i, p, h in zip(rows, ps, hs):
        if p.needs_history and h is None:
            raise ValueError(f"row {i} uses penalties or min_tokens but has no token history")
    idx = torch.tensor(rows, device=logits.device)
    fusable = fused.can_sample(logits)      # bf16 or fp32 on the CPU: the fused kernels sample the adjusted copy
    x = logits.index_select(0, idx)
    if not fusable:
        x = x.float()
    apply_min_tokens(x, ps, hs, eos_token_ids)
    apply_logit_bias(x, ps)
    apply_penalties(x, ps, hs)
    greedy = [j for j, p in enumerate(ps) if p.greedy]
    if len(greedy) == len(rows):
        tokens[idx] = fused.argmax(x)
    elif greedy:
        g = torch.tensor(greedy, device=x.device)
        tokens[idx[g]] = fused.argmax(x.index_select(0, g))
    drawn = [j for j, p in enumerate(ps) if not p.greedy]
    simple = [j for j in drawn if ps[j].top_k <= 0 and ps[j].top_p == 1] if fusable else []
    if simple:
        d = torch.tensor(simple, device=x.device)
        temperatures = torch.tensor([ps[j].temperature for j in simple], dtype=torch.float32)
        cut = [j for j in simple if ps[j].min_p > 0]
        if cut:        # p < min_p * p_max  <=>  x < max(x) + T * ln(min_p): no softmax needed
            c = torch.tensor(cut, device=x.device)
            xc = x.index_select(0, c)
            shift = torch.tensor([ps[j].temperature * math.log(ps[j].min_p) for j in cut], device=x.device)
            cutoff = (xc.amax(dim=-1, keepdim=True).float() + shift[:, None]).to(xc.dtype)
            xc.masked_fill_(xc < cutoff, float("-inf"))
            x.index_copy_(0, c, xc)
        u = _uniforms([rows[j] for j in simple], generators, logits.device)
        tokens[idx[d]] = fused.sample_rows(x, d, temperatures, u)
        drawn = [j for j in drawn if not (ps[j].top_k <= 0 and ps[j].top_p == 1)]
    if drawn:
        d = torch.tensor(drawn, device=x.device)
        dp = [ps[j] for j in drawn]
        temperatures = torch.tensor([p.temperature for p in dp], dtype=torch.float32, device=x.device)
        xs = x.index_select(0, d).float().div_(temperatures[:, None])
        if any(p.min_p > 0 for p in dp):
            xs = apply_min_p(xs, torch.tensor([p.min_p for p in dp], dtype=torch.float32, device=x.device))
        u = _uniforms([rows[j] for j in drawn], generators, logits.device)
        tokens[idx[d]] = _invert(xs, dp, u, any(p.top_k > 0 or p.top_p < 1 for p in dp))
    return tokens


def apply_min_tokens(x: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None],
                     eos_token_ids=()) -> None:
    """In place: rows that generated fewer than min_tokens tokens get -inf at their stop tokens
    (stop_token_ids, and EOS unless ignore_eos)."""
    vocab = x.shape[1]
    rows, ids = [], []
    for j, (p, h) in enumerate(zip(params, histories)):
        if p.min_tokens > 0 and h.num_output < p.min_tokens:
            stop = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
            stop = [t for t in stop if t < vocab]
            rows += [j] * len(stop)
            ids += stop
    if ids:
        x[torch.tensor(rows, device=x.device), torch.tensor(ids, device=x.device)] = float("-inf")


def apply_logit_bias(x: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place: each row's logit_bias added to its tokens' logits (in float32, stored in x's dtype)."""
    rows, ids, biases = [], [], []
    for j, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(j)
            ids.append(token)
            biases.append(bias)
    if not ids:
        return
    r, t = torch.tensor(rows, device=x.device), torch.tensor(ids, device=x.device)
    b = torch.tensor(biases, dtype=torch.float32, device=x.device)
    x[r, t] = (x[r, t].float() + b).to(x.dtype)


def apply_penalties(x: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]) -> None:
    """In place, on the rows with a penalty, touching only the tokens they have seen (computed in
    float32, stored in x's dtype):
    repetition_penalty over prompt + output (logit / r where > 0, else logit * r), then
    logit -= frequency_penalty * count and presence_penalty * (count > 0) over the output."""
    vocab = x.shape[1]
    flat = x.view(-1)
    rep = [j for j, p in enumerate(params) if p.repetition_penalty != 1]
    if rep:
        keys = _unique_keys([histories[j].tensor(0) for j in rep], rep, vocab, x.device)[0]
        r = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=x.device)[keys // vocab]
        v = flat[keys].float()
        flat[keys] = torch.where(v > 0, v / r, v * r).to(x.dtype)
    fp = [j for j, p in enumerate(params) if p.frequency_penalty != 0 or p.presence_penalty != 0]
    if fp:
        keys, counts = _unique_keys([histories[j].tensor(histories[j].num_prompt) for j in fp], fp, vocab, x.device)
        if keys.numel():
            row = keys // vocab
            f = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=x.device)[row]
            pr = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=x.device)[row]
            flat[keys] = (flat[keys].float() - f * counts.float() - pr).to(x.dtype)


def _unique_keys(ids: list[torch.Tensor], rows: list[int], vocab: int, device):
    """The distinct (row, token) pairs of each row's ids, as row * vocab + token, with their counts."""
    lengths = torch.tensor([len(t) for t in ids])
    keys = torch.cat(ids) + torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64) * vocab, lengths)
    keys, counts = torch.unique(keys.to(device), return_counts=True)
    return keys, counts


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits with the tokens whose probability is below min_p * the row's
    largest probability set to -inf."""
    probs = x.softmax(dim=-1)
    low = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill_(low, float("-inf"))


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor
                   ) -> list[TokenLogprobs | None] | None:
    """Per row that asked (params.logprobs not None): the sampled token's log probability and the
    top-N, from log_softmax of the raw logits (the model's distribution before penalties,
    temperature and filters, as vLLM returns by default). None when no row asked."""
    if all(p.logprobs is None for p in params):
        return None
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    idx = torch.tensor(rows, device=logits.device)
    found = _logprobs(logits.index_select(0, idx), tokens.index_select(0, idx), [params[i].logprobs for i in rows])
    out: list[TokenLogprobs | None] = [None] * len(params)
    for i, lp in zip(rows, found):
        out[i] = lp
    return out


def logprobs_of(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprobs]:
    """Row i of logits [len(token_ids), V] scores token_ids[i] (a prompt's next token): its log
    probability and the top_n best, from log_softmax of the raw logits, as token_logprobs."""
    if not token_ids:
        return []
    return _logprobs(logits, torch.tensor(token_ids, device=logits.device), [top_n] * len(token_ids))


def _logprobs(x: torch.Tensor, chosen_ids: torch.Tensor, top_ns: list[int]) -> list[TokenLogprobs]:
    """Row i of x: chosen_ids[i]'s log probability and the top_ns[i] best, from log_softmax(x[i])."""
    # log_softmax = x - logsumexp(x), computed only where read; 16 rows at a time stay in cache
    lse = torch.cat([c.float().logsumexp(dim=-1, keepdim=True) for c in x.split(16)])
    chosen = (x.gather(1, chosen_ids[:, None]).float() - lse)[:, 0].tolist()
    k = max(top_ns)
    if k > 0:
        top_v, top_i = x.topk(min(k, x.shape[1]), dim=-1)
        top_v, top_i = (top_v.float() - lse).tolist(), top_i.tolist()
    return [TokenLogprobs(tok, chosen[j], list(zip(top_i[j][:n], top_v[j][:n])) if n else [])
            for j, (tok, n) in enumerate(zip(chosen_ids.tolist(), top_ns))]


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
