"""The drafter a decode engine runs for its ``DraftSpec``."""

from __future__ import annotations

from decode.drafters.base import Drafter
from decode.drafters.draft_model import DraftModelDrafter
from decode.drafters.eagle import EagleDrafter
from decode.drafters.lookup_first import LookupFirstDrafter
from decode.drafters.ngram import NgramDrafter
from models.spec import DraftKind, DraftSpec
from runtime.runner import EagleRunner, ModelRunner


def build_drafter(spec: DraftSpec, runner: ModelRunner | EagleRunner | None) -> Drafter | None:
    drafter: Drafter | None = None
    if isinstance(runner, EagleRunner):
        drafter = EagleDrafter(runner, spec.tree_width)
    elif runner is not None:
        drafter = DraftModelDrafter(runner)
    elif spec.kind is DraftKind.NGRAM:
        return NgramDrafter(spec.ngram_max, spec.ngram_min)
    if drafter is not None and spec.lookup_first:
        return LookupFirstDrafter(NgramDrafter(spec.ngram_max, spec.ngram_min), drafter)
    return drafter
