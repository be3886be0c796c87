"""``StepMetadata``: where each row of one step is, in one frozen object that every relay call of the step reads.

FlashInfer's wrappers take a step's layout once in ``plan()`` and only tensors in ``run()``; here the layout is this
object and the plan is ``plan.plan_for(metadata, options, ...)``: the first layer of a step (per
``AttentionOptions.key``) plans, every later layer finds the plan in ``plans``, a dict the step's holder shares among
the layers that read one prefix layout (a ``RelayCache`` per groups view, a paged step per step). No layer call
searches a global table.

The dynamic and static caches (``layers.RelayLayer``) and continuous batching's paged step (``paged.PagedStep``) all
describe their rows with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .groups import GroupTables, PrefixGroups


@dataclass(frozen=True, eq=False)
class StepMetadata:
    """One step's row layout.

    Attributes:
        suffix_lengths: ``[B]`` integer on the query's device: each row's valid suffix positions (its last ones, or
            the last ones ending at ``suffix_end``), or ``None`` when every suffix position is valid.
        suffix_end: one-element integer on the query's device, or ``None``: the filled positions of a static
            (preallocated, CUDA-graph friendly) suffix buffer. Read on the device, so a captured graph replays
            correctly as it grows.
        groups: which packed prefix segments each row reads (``PrefixGroups``; inside ``torch.compile`` the
            ``GroupTables`` built ahead), or ``None``: every row reads the whole prefix.
        plans: the kernel plans of this layout by ``AttentionOptions.key`` (``plan.plan_for``), shared by the layers
            that read this layout; not part of the layout (a fresh dict per object unless the holder hands one over).
            ``None``: no holder keeps plans for this step (a free function's call, made once): its plan is its
            layout's, found by ``plan.plan_relay`` alone.

    Identity is equality: two steps are the same step only as one object.
    """

    suffix_lengths: torch.Tensor | None = None
    suffix_end: torch.Tensor | None = None
    groups: PrefixGroups | GroupTables | None = None
    plans: dict | None = field(default_factory=dict, compare=False, repr=False)

    def with_lengths(self, suffix_lengths: torch.Tensor | None) -> StepMetadata:
        """The same layout with the rows' valid lengths given (the dynamic cache's attention mask knows them); the
        plans stay shared."""
        return replace(self, suffix_lengths=suffix_lengths)


__all__ = ["StepMetadata"]
