"""What a generation gives back: its tokens and text, why it stopped, its counters (rounds,
drafts kept, fallback rounds and rounds without drafts by choice, where its time went) and,
when asked, each token's log-probability under the target's own distribution."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from starsd_target.profile import RoundProfile


@dataclass
class GenerationStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_rounds: int = 0  # rounds that wanted drafts but verified without them
    plain_rounds: int = 0  # rounds verified without drafts by choice (a crowded target, drafting that did not pay)
    invalid_drafts: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    cached_prompt_tokens: int = 0  # prompt positions taken from an earlier prompt's kept chunks, not prefilled
    wall_s: float = 0.0
    accepted_by_position: list[int] = field(default_factory=list)
    max_draft_tokens: int = 0  # the draft tokens a round verifies at most (0: this generation speculates not)
    asked_tokens: int = 0  # drafts its rounds' requests asked for, in all (adaptive depth: at most the cap each)
    tree_rounds: int = 0  # rounds that verified a draft tree
    tree_tokens: int = 0  # the most tokens a round's tree holds (0: chains only)
    fill_steps: int = 0  # steps the target took on its own while drafts were on their way (--fill-steps)
    fill_confirmed: int = 0  # drafts that began with those steps' tokens (counted in drafted and accepted)
    profile: RoundProfile = field(default_factory=RoundProfile)  # where its rounds' time went (the scheduler's)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per target forward (kept drafts plus the target's own token)."""
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted_length"] = self.mean_accepted_length
        d["tokens_per_s"] = self.tokens_per_s
        d["speculate"] = self.max_draft_tokens > 0
        return d


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target model's own distribution: the
    log-softmax of its raw logits at that position (before temperature, top-k and top-p), and
    ``top``, the most likely tokens there as (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked for them
