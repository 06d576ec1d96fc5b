"""Pausing the cyclic garbage collector around work that allocates many small acyclic objects
(:func:`gc_paused`): the planner, the plan document reader, a cluster's device list.

Pure: no torch, torch.distributed, deepspeed or megatron.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: planning at 131,072 GPUs allocates millions of small
    acyclic objects, and each full collection would walk all of them (pauses of a large fraction
    of a second). Reference counting still frees everything. What survives (the plan: a few
    hundred thousand objects at 131,072 GPUs) is moved to the oldest generation on the way out
    (``gc.freeze`` then ``gc.unfreeze``: two list splices) instead of being walked by the young
    generation's next collection (about a fifth of a re-plan's time there); the next full
    collection sees it like any long-lived object. Skipped when the process has frozen objects of
    its own (``unfreeze`` would release them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
