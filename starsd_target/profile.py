"""Where a target's rounds spend their time: each round's wall time split into parts that add up to it.

A generation's round runs from the end of its previous round (or of its prefill) to the end of
its verification. Its parts:

* ``draft_wait``: from the DRAFT request's send to the scheduler taking its reply (or giving it
  up), counted within the round; a reply that sat unread while the target did other work counts.
  It splits into ``draft_queue`` and ``draft_forward`` (what the draft daemon reports in DRAFTED:
  waiting for its batch, its batch's backend call) and ``wire``, the remainder (network, both
  sides' sockets and encoding, the daemon's decode and checks, the reply sitting unread).
  Without the daemon's report (an older daemon, a request given up) the whole wait is wire.
* ``verify_forward``: the target model's forward over the round's tokens, logits to host included.
* ``verify_math``: the rest of ``Generation.verify``: the drafts' validation, dense q, the
  acceptance test, the cache crop, features, token bookkeeping, the stop-string check.
* ``fill``: the target's own steps taken while the drafts were on their way (``--fill-steps``),
  whole; ``draft_wait`` is then only the time the target still waited for them.
* ``rest``: the round's wall time less the three above: the scheduler's own work, encoding and
  sending the request, polling, and other generations' rounds and prefill chunks meanwhile.

So ``draft_wait + verify_forward + verify_math + fill + rest`` is the round's wall time, and
``draft_queue + draft_forward + wire`` is ``draft_wait``, by construction: nothing goes unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUND_PARTS = ("draft_wait", "verify_forward", "verify_math", "fill", "rest")  # add up to the round's wall time
DRAFT_WAIT_PARTS = ("draft_queue", "draft_forward", "wire")  # add up to draft_wait
PARTS = ROUND_PARTS + DRAFT_WAIT_PARTS


@dataclass(frozen=True)
class RoundTimes:
    """One round's parts, in seconds (see the module's docstring)."""

    wall: float
    draft_wait: float
    draft_queue: float
    draft_forward: float
    wire: float
    verify_forward: float
    verify_math: float
    rest: float
    waited: bool  # a draft request was in flight during the round
    reported: bool  # the draft daemon said where the request's time went
    fill: float = 0.0


def split_round(wall: float, wait: float, reported: tuple[float, float] | None, forward: float,
                math: float, waited: bool | None = None, fill: float = 0.0) -> RoundTimes:
    """A round's parts from what was measured: its wall time, the draft wait within it, what the
    draft daemon reported (queued, drafting; None: nothing), the verification's forward and math.
    ``waited``: a draft request was in flight for this round (default: ``wait > 0``; a reply that
    came during the prefill leaves a wait of 0 within the round); ``fill``: its fill steps'
    seconds. The daemon's figures are trusted only up to the wait the target saw."""
    queue = draft = 0.0
    if reported is not None:
        draft = min(max(reported[1], 0.0), wait)
        queue = min(max(reported[0], 0.0), wait - draft)
    waited = wait > 0.0 if waited is None else waited
    return RoundTimes(wall, wait, queue, draft, wait - queue - draft, forward, math,
                      wall - wait - forward - math - fill, waited or reported is not None, reported is not None, fill)


@dataclass
class RoundProfile:
    """Cumulative seconds per part and, per part, the rounds it applied to (draft parts only to
    rounds that waited for drafts; the daemon's to those it reported on). Read by other threads:
    its dictionaries keep their keys, only the values change."""

    rounds: int = 0
    wall_s: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    def add(self, t: RoundTimes) -> None:
        s, c = self.seconds, self.counts
        for part in PARTS:
            s[part] += getattr(t, part)
        for part in ("verify_forward", "verify_math", "rest"):
            c[part] += 1
        if t.fill:
            c["fill"] += 1
        if t.waited:
            c["draft_wait"] += 1
            c["wire"] += 1
        if t.reported:
            c["draft_queue"] += 1
            c["draft_forward"] += 1
        self.wall_s += t.wall
        self.rounds += 1

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "wall_s": self.wall_s, "seconds": dict(self.seconds),
                "counts": dict(self.counts)}


def ms_per_round(profile: dict) -> dict[str, float]:
    """Milliseconds per round of each part and of the round (``round``), from ``RoundProfile.to_dict()``
    (or the sum of several: each part's seconds over all the rounds, so the parts add up)."""
    n = profile.get("rounds", 0)
    if not n:
        return {}
    out = {part: 1000.0 * s / n for part, s in profile["seconds"].items()}
    out["round"] = 1000.0 * profile["wall_s"] / n
    return out


def merge(profiles: list[dict]) -> dict:
    """The sum of several ``RoundProfile.to_dict()`` results."""
    total = RoundProfile().to_dict()
    for p in profiles:
        total["rounds"] += p.get("rounds", 0)
        total["wall_s"] += p.get("wall_s", 0.0)
        for part in PARTS:
            total["seconds"][part] += p.get("seconds", {}).get(part, 0.0)
            total["counts"][part] += p.get("counts", {}).get(part, 0)
    return total


def describe(profile: dict) -> str:
    """One line: milliseconds per round, by part."""
    ms = ms_per_round(profile)
    if not ms:
        return "no rounds yet"
    return (f"{ms['round']:.1f} ms per round over {profile['rounds']} rounds: draft wait {ms['draft_wait']:.1f} "
            f"(daemon queue {ms['draft_queue']:.1f}, draft forwards {ms['draft_forward']:.1f}, wire "
            f"{ms['wire']:.1f}), verify forward {ms['verify_forward']:.1f}, verify math {ms['verify_math']:.1f}, "
            f"fill steps {ms.get('fill', 0.0):.1f}, rest {ms['rest']:.1f}")
