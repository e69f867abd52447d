"""Choosing the target's token at each position, and deciding how many draft tokens it accepts.

Acceptance rule (DFLASH_SPEC.md section 3): the target picks its own token at every block position (argmax at T=0,
a sample from its processed distribution at T>0); draft token k is accepted iff it equals the target's pick at the
position before it, up to the first mismatch. With deterministic (one-hot) drafts this is exactly speculative
rejection sampling, so the output has the target's distribution. Top-k, top-p and min-p are applied to the target's
distribution the same way in every method.

Penalties (OpenAI's presence and frequency penalties over the generated tokens, the repetition penalty of
transformers and vLLM over prompt and generated tokens), OpenAI's logit_bias, vLLM's allowed_token_ids, bad_words
and min_tokens (no stop token before that many new tokens) change the target's logits before anything else. At each
position of a verify block they count the tokens before it, the block's drafts included: a draft after that
position only matters if every draft up to it is accepted, so the counts are exactly those a plain step would see.

Seeded sampling draws the token at sequence position p by inverting the target's distribution at a uniform number
that depends only on (seed, p). So a seeded generation is the same whatever drafts were proposed and however many
were verified: speculative decoding with any method, adaptive or not, batched or not, gives exactly the tokens plain
sampling gives with that seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import UserError


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted from a token's logit once it has been generated
    frequency_penalty: float = 0.0  # subtracted once for every time it has been generated
    repetition_penalty: float = 1.0  # divides a positive logit of a token in the prompt or output, multiplies a negative
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to these tokens' logits (OpenAI's logit_bias)
    min_p: float = 0.0  # 0 = off; keeps the tokens at least min_p times as likely as the likeliest (vLLM's min_p)
    min_tokens: int = 0  # no stop token (EOS, stop_token_ids) before this many new tokens (vLLM's min_tokens)
    allowed_token_ids: tuple[int, ...] = ()  # where given, the only tokens the output may have (vLLM's)
    # vLLM's bad_words as token sequences (bad_word_ids): a sequence's last token is barred where the output's last
    # tokens are the rest of it
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # the allowed tokens' mask per (vocab, device), made at its first use: a long list costs ms a round to index
    # (not an init field, so `replace` with other allowed tokens starts a cache of its own)
    _allowed_masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    held_back: tuple[int, ...] = ()  # those stop tokens: the engine fills them in (Engine.submit)

    def validate(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise UserError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise UserError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -100 <= bias <= 100:
                raise UserError(f"logit_bias takes token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise UserError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(token < 0 for token in self.allowed_token_ids):
            raise UserError(f"allowed_token_ids takes token ids >= 0, got {list(self.allowed_token_ids)}")

    def barred_by_allowed(self, vocab: int, device) -> torch.Tensor:
        """True for the tokens allowed_token_ids leaves out, [vocab]."""
        key = (vocab, str(device))
        if key not in self._allowed_masks:
            barred = torch.ones(vocab, dtype=torch.bool)
            barred[[token for token in self.allowed_token_ids if token < vocab]] = False
            self._allowed_masks[key] = barred.to(device)
        return self._allowed_masks[key]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def penalized_after(self, generated: int) -> bool:
        """Whether the target's logits are changed (penalized_logits) once `generated` tokens are written: by the
        penalties and biases always, by min_tokens's held-back stop tokens only before it."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or bool(self.allowed_token_ids) or bool(self.bad_word_ids)
                or (generated < self.min_tokens and bool(self.held_back)))


def penalized_logits(logits: torch.Tensor, cfg: SamplingConfig, history: list[int], prompt_len: int,
                     block: list[int]) -> torch.Tensor:
    """`logits` [n, vocab] of n consecutive positions, penalised and biased: position j follows `history`
    (prompt_len prompt tokens, then generated ones) and block[:j]."""
    vocab, n, device = logits.shape[-1], logits.shape[0], logits.device
    generated = torch.tensor(history[prompt_len:], dtype=torch.long, device=device)
    prompt = torch.tensor(history[:prompt_len], dtype=torch.long, device=device)
    # counts[j]: how often each token was generated before position j
    counts = torch.bincount(generated, minlength=vocab)[:vocab].float().repeat(n, 1)
    for j, token in enumerate(block[: n - 1], start=1):
        counts[j:, token] += 1
    logits = logits.float().clone()
    if cfg.repetition_penalty != 1:
        seen = counts > 0
        seen[:, prompt[prompt < vocab]] = True
        scaled = torch.where(logits > 0, logits / cfg.repetition_penalty, logits * cfg.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    logits = logits - cfg.presence_penalty * (counts > 0) - cfg.frequency_penalty * counts
    for token, bias in cfg.logit_bias.items():
        if token < vocab:
            logits[:, token] += bias
    if cfg.allowed_token_ids:
        logits = logits.masked_fill(cfg.barred_by_allowed(vocab, device), float("-inf"))
    if cfg.bad_word_ids:
        start = max(prompt_len, len(history) - max(len(word) for word in cfg.bad_word_ids))  # generated only
        written = history[start:] + list(block[: n - 1])
        before = len(history) - start  # position j follows written[:before + j]
        for j in range(n):
            for word in cfg.bad_word_ids:
                end, rest = before + j, len(word) - 1
                if word[-1] < vocab and end >= rest and written[end - rest: end] == list(word[:-1]):
                    logits[j, word[-1]] = float("-inf")
    early = min(n, cfg.min_tokens - (len(history) - prompt_len))  # positions before the min_tokens-th new token
    held = [token for token in cfg.held_back if token < vocab]
    if early > 0 and held:
        logits[:early, held] = float("-inf")
    return logits


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution the target samples from: temperature, then top-k, then top-p, then min-p (HF's order)."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        logits = logits.masked_fill(outside_top_p(logits, cfg.top_p), float("-inf"))
    probs = logits.softmax(-1)
    if cfg.min_p > 0:  # the likeliest token always stays
        probs = probs.masked_fill(probs < cfg.min_p * probs.max(-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


TOP_P_CANDIDATES = (256, 4096)  # where the nucleus is looked for first, row by row, before sorting a whole row


def outside_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """True for the tokens top-p drops from each row of `logits` [rows, vocab]: a token goes when the tokens ranked
    above it already hold top_p of the mass (the first always stays). Each row is ranked among its 256 most likely
    tokens if they hold top_p, else among its 4096, and only else sorted whole: sorting all 49,152 of SmolLM2's
    takes ~3.4 ms a row on one core, the 4096 likeliest 0.33 ms, and one flat row no longer sorts the others."""
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    outside = torch.ones_like(logits, dtype=torch.bool)
    pending = None  # every row (no copy of the logits) until some row needs more candidates
    for candidates in (*TOP_P_CANDIDATES, logits.shape[-1]):
        rows, totals = (logits, log_total) if pending is None else (logits[pending], log_total[pending])
        if candidates >= logits.shape[-1]:
            top, order = torch.sort(rows, dim=-1, descending=True)
        else:
            top, order = torch.topk(rows, candidates, dim=-1)
        probs = (top - totals).exp()
        cumulative = probs.cumsum(-1)
        # the whole vocabulary's mass is 1 up to rounding: every row is found there
        found = cumulative[:, -1] >= top_p if candidates < logits.shape[-1] else torch.ones_like(top[:, 0], dtype=torch.bool)
        dropped = (cumulative - probs) >= top_p
        if pending is None and bool(found.all()):
            return outside.scatter_(-1, order, dropped)
        if pending is None:
            pending = torch.arange(logits.shape[0], device=logits.device)
        done = pending[found]
        outside[done] = torch.ones((len(done), logits.shape[-1]), dtype=torch.bool, device=logits.device).scatter_(
            -1, order[found], dropped[found])
        pending = pending[~found]
        if len(pending) == 0:
            break
    return outside


def pick_tokens(logits: torch.Tensor, cfg: SamplingConfig, first_position: int = 0) -> torch.Tensor:
    """The target's choice at each position of `logits` [seq, vocab] -> [seq]; row i picks the token at sequence
    position first_position + i (which fixes its random number when the sampling is seeded)."""
    if cfg.greedy:
        return logits.argmax(-1)
    probs = target_probs(logits, cfg)
    if cfg.seed is None:
        uniform = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    else:
        uniform = torch.tensor([position_uniform(cfg.seed, first_position + i) for i in range(probs.shape[0])],
                               dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(-1)
    return picked.clamp(max=probs.shape[-1] - 1)


MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in (0, 1) fixed by (seed, position): SplitMix64 of the pair, 53 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return ((z >> 11) + 0.5) / (1 << 53)


def accept_length(draft_tokens: list[int], target_tokens: list[int]) -> int:
    """Number of leading draft tokens equal to the target's choice at the preceding position."""
    accepted = 0
    for drafted, chosen in zip(draft_tokens, target_tokens):
        if drafted != chosen:
            break
        accepted += 1
    return accepted


def bad_word_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as the token sequences that spell them, each word alone and after a space (a word inside a
    sentence is usually another token than the same word at its start)."""
    sequences = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise UserError(f"bad_words are non-empty strings, got {word!r}")
        for spelled in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(spelled, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)
