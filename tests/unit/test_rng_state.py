"""RNG state in a checkpoint's rank state: the generators continue as they would have after a
save, a JSON round trip and a restore; the Mersenne-Twister words are stored as base64 strings,
and the lists of numbers earlier versions stored still restore. Oracle: the generators' own draws
(taken before the restore from a copy of each state held by the test)."""
from __future__ import annotations

import json
import random

import numpy as np
import torch

from elastor_ds.checkpoint.state import capture_rng_state, restore_rng_state


def _draws() -> tuple:
    return (random.random(), random.getrandbits(64), float(np.random.rand()), int(np.random.randint(1 << 30)),
            torch.rand(3).tolist())


def test_capture_json_restore_continues_every_generator():
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    _draws()
    st = json.loads(json.dumps(capture_rng_state()))
    assert isinstance(st["python"][1], str) and isinstance(st["numpy"][1], str)   # compact words
    want = _draws()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_rng_state(st)
    assert _draws() == want


def test_the_list_form_of_earlier_versions_still_restores():
    random.seed(21)
    np.random.seed(22)
    py, npst = random.getstate(), np.random.get_state()
    old = {"python": [py[0], list(py[1]), py[2]],
           "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])]}
    want = (random.random(), float(np.random.rand()))
    random.seed(1)
    np.random.seed(1)
    restore_rng_state(json.loads(json.dumps(old)))
    assert (random.random(), float(np.random.rand())) == want
