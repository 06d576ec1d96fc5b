"""A small, fast subset of bench/fault_campaign.py (the whole campaign: bench/README.md): every
trial of these classes must be detected, with nothing lost, no hang and no traceback."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
fault_campaign = pytest.importorskip("fault_campaign")


def test_campaign_subset(tmp_path, capsys):
    rc = fault_campaign.main(["--seed", "1", "--classes",
                              "ds-config,trainer-flags,path-escape,non-empty-destination,sigkill-save,sigkill-job",
                              "--kills", "30", "--job-kills", "10", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| sigkill-job | 10 | 10 | 0 | 0 | 0 |" in out, out
    assert rc == 0, out
