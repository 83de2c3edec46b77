"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), seeded.

    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1, max_tokens=32, stop=["."])
    params.check()                                   # ValueError, one line, for bad values
    chooser = Chooser(params)
    token, logprob, top = chooser(logits)            # logits (vocab,) of one sequence
    tokens, logprobs = greedy(step_logits)           # (n, vocab): many greedy rows at once

temperature 0 (or below 1e-5) is greedy (top_k, top_p and seed do not matter then). Otherwise
the logits are divided by the temperature, cut to the top_k most likely (0: all), then to the
smallest set whose probabilities reach top_p (the most likely token always stays),
renormalized, and one token drawn with the sequence's own torch.Generator (seeded: the same request gives the same
text; any integer seed, taken modulo 2**64). logprob is the chosen token's log-probability
under the unmodified distribution (what OpenAI's API reports), top the `logprobs` most likely
(token, logprob) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.gen.kv_pool import _decode  # (None: not built, stale, or HKSTORE_NO_ACCEL)


# Temperatures below this are greedy, as vLLM's (its _SAMPLING_EPS): float32 logits divided by
# a far smaller one overflow to inf, or by one that rounds to 0 in float32 become NaN.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)  # stop sequences (text); the output ends before one
    logprobs: int = 0  # how many top alternatives to report per token (0: none)
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens or a stop sequence (benchmarks, tests)

    def check(self) -> SamplingParams:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 4:
            raise ValueError("stop must be a list of at most 4 non-empty strings")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be an integer between 0 and 20, got {self.logprobs!r}")
        if self.ignore_eos is not True and self.ignore_eos is not False:
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        return self


class Chooser:
    """The next-token rule of one sequence (it owns the sequence's random generator)."""

    def __init__(self, params: SamplingParams):
        self.params = params.check()
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(generator_seed(params.seed))
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor,
                 logprobs: torch.Tensor | None = None) -> tuple[int, float, list[tuple[int, float]]]:
        """(token, its logprob, top alternatives); the log-softmax of logits may come
        precomputed (the batcher's, for every such sequence of a step at once)."""
        p = self.params
        logits = logits.float()
        if logprobs is None:
            logprobs = torch.log_softmax(logits, -1)
        if p.temperature < GREEDY_BELOW:
            token = int(logits.argmax())
        else:
            scaled = logits / p.temperature
            if p.top_k and p.top_k < scaled.numel():
                kth = scaled.topk(p.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if p.top_p < 1:
                probs, order = scaled.softmax(-1).sort(descending=True)
                # keep a token while the mass before it is below top_p (the first always stays)
                drop = (probs.cumsum(-1) - probs) >= p.top_p
                drop[0] = False  # explicitly: a top_p below float32's smallest number compares as 0
                scaled = scaled.index_fill(0, order[drop], float("-inf"))
            token = int(torch.multinomial(scaled.softmax(-1), 1, generator=self.generator))
        top = []
        if p.logprobs:
            values, ids = logprobs.topk(p.logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        return token, float(logprobs[token]), top


def greedy(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's argmax of logits (n, vocab) and its log-probability: what Chooser gives a
    greedy row without top alternatives. On the CPU one C pass for the argmax and one for the
    sum of exponentials (runtime/gen/_decode.c, built with the package); rows with a NaN or an
    infinite top, and a build without it, take the reference (greedy_reference)."""
    logits = logits.float()
    if _decode is not None and logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] and \
            logits.stride(1) == 1 and logits.shape[0]:
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        logprobs = torch.empty(logits.shape[0], dtype=torch.float64)
        if _decode.greedy(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), tokens.data_ptr(),
                          logprobs.data_ptr()):
            return tokens.tolist(), logprobs.tolist()
    return greedy_reference(logits)


def greedy_reference(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """greedy in array ops: numpy's argmax (about a tenth of torch's CPU time over a 50k
    vocabulary, the same first-index rule on ties and NaN), then log_softmax at the max, which
    is -log sum(exp(x - max))."""
    logits = logits.float()
    if logits.device.type == "cpu":
        tokens = torch.from_numpy(np.argmax(logits.detach().numpy(), -1))
    else:
        tokens = logits.argmax(-1)
    top = logits.gather(1, tokens[:, None].to(logits.device))
    logprobs = (logits - top).exp_().sum(-1).log_().neg_()
    return tokens.tolist(), logprobs.tolist()


def generator_seed(seed: int) -> int:
    """Any integer as a torch.Generator seed: its residue modulo 2**64. OpenAI's API takes any
    integer seed, torch.Generator only 64 bits; the residue keeps every seed in [0, 2**64) as it
    is (and a negative one as its two's complement), so the same request still gives the same text."""
    return seed % (1 << 64)


def find_stop(text: str, stops: list[str], start: int = 0) -> int:
    """Index in text where the earliest stop sequence at or after start begins, -1 if none occurs."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else -1
