"""The target's round policy: what one generation's next round asks the draft daemon for.

``plan_round`` decides from plain values and returns a ``RoundPlan``; the scheduler executes it
(sends the request, or readies a round without drafts) and feeds the verified round back to the
generation's draft-length controller (as vLLM's scheduler returns a SchedulerOutput that the model
runner executes). The rules:

* a generation with no draft session, or no room for a draft, asks for none (a round of its own);
* a crowded target (``crowded_round``) runs the round without drafts, by choice (a plain round);
  so does a generation whose controller finds that drafting does not pay (``drafts_pay``);
* a tree where the generation's budget and the daemon allow one (its depth then stays: adaptive
  depth models chains); where the daemon stops greedy drafts itself, with the controller's
  ``min_survival`` and ``min_chance``, below which a node does not pay its verified row (the
  daemon neither feeds nor sends it: on a CPU, where rows cost, the tree shrinks towards the
  chain);
* else a chain: where the daemon stops greedy chains itself, the cap with the controller's
  ``min_survival`` (and ``min_chance`` for drafts copied from text already seen); otherwise the
  controller's length within the cap (the cap without one).

A seeded sampled generation keeps the cap every round and always drafts (``keeps_cap``): the
target's random draws follow its rounds, and the same seed must give the same tokens whatever
the target serves and however fast it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.verify import SamplingParams
from starsd_target.depth import AdaptiveDepth


@dataclass(frozen=True)
class RoundPlan:
    wanted: bool  # the generation drafts in principle (a draft session, and room for a draft)
    depth: int = 0  # draft tokens a chain asks for (0: the round asks for none)
    budget: int = 0  # tree tokens the request asks for (0: a chain)
    min_survival: float = 0.0  # > 0: the daemon ends the greedy chain itself, within the depth
    min_chance: float = 0.0  # > 0: the same for drafts copied from text already seen (no drafting cost)
    crowded: bool = False  # the round runs without drafts because the target is crowded

    @property
    def drafts(self) -> bool:
        """The round sends a draft request."""
        return self.wanted and self.depth > 0

    @property
    def plain(self) -> bool:
        """The round runs without drafts by choice (the target alone is expected to be faster)."""
        return self.wanted and self.depth == 0


def keeps_cap(params: SamplingParams) -> bool:
    """A seeded sampled generation: its draft length stays the cap and it is never held back
    from drafting, so the same seed gives the same tokens."""
    return params.seeded


def crowded_round(limit: int, max_batch: int, batchable: bool, params: SamplingParams,
                  batchable_active: int) -> bool:
    """Whether a generation's next round runs without drafts because more generations are
    active than ``limit`` (``draft_max_active``) lets draft: on a CPU, verifying drafts for every
    generation of a batch costs more than the tokens they add, where one batched forward without
    drafts gives each a token. Decided per round from the count alone (``batchable_active``, the
    active generations whose cache is a pool row), so a generation drafts again once others
    finish. Rounds without drafts gain only by sharing a forward, so only a ``batchable``
    generation is held back, and never where the engine verifies one generation per forward
    (``max_batch`` 1: batching off). A seeded sampled generation always drafts (``keeps_cap``)."""
    if not (limit > 0 and max_batch > 1 and batchable):
        return False
    if keeps_cap(params):
        return False
    return batchable_active > limit


def plan_round(cap: int, *, session: bool, crowded: bool = False, trees: bool = False, budget: int = 0,
               stops_drafts: bool = False, greedy_drafts: bool = False,
               depth: AdaptiveDepth | None = None) -> RoundPlan:
    """The next round's plan. ``cap``: the most drafts the round may ask for (the generation's
    ``draft_depth()``); ``session``: it has a draft session; ``crowded``: ``crowded_round``'s
    verdict; ``trees``: the daemon drafts trees, and ``budget`` the generation's tree budget
    (``draft_budget()``, 0: a chain); ``stops_drafts``: the daemon ends greedy chains itself, and
    ``greedy_drafts`` whether it drafts greedily for this generation; ``depth``: the generation's
    draft-length controller (None: the cap every round). Choosing a length records it in the
    controller (``AdaptiveDepth.choose``)."""
    if not (session and cap > 0):
        return RoundPlan(wanted=False)
    if crowded:
        return RoundPlan(wanted=True, crowded=True)
    budget = budget if trees else 0
    survival = chance = 0.0
    stops = depth is not None and stops_drafts and greedy_drafts
    if depth is not None and not budget:
        if not depth.drafts_pay():  # the target alone is expected to be faster: a plain round
            return RoundPlan(wanted=True)
        if not stops:
            cap = depth.choose(cap)
    if stops:
        # the daemon ends a chain within the cap, and keeps a tree to the nodes that pay their
        # row, by the same thresholds
        survival = depth.min_survival()
        chance = min(depth.min_chance(), survival)
    return RoundPlan(wanted=True, depth=cap, budget=budget, min_survival=survival, min_chance=chance)
