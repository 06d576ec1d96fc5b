"""A small, fast subset of tests/faults/fault_campaign.py (the whole campaign: bench/README.md): every
trial of these classes must be detected, with nothing lost, no hang and no traceback."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the campaign lives beside this test
import fault_campaign  # noqa: E402 - an import error fails the tier, it never turns into a skip


@pytest.mark.timeout(900)
def test_campaign_subset(tmp_path, capsys):
    """Every class of the campaign but the slow job-level ones (final-save, overlap-roots, sigkill of
    the trainer under the controller: their findings have their own tests), at small counts."""
    if os.geteuid() != 0:
        pytest.fail("the enospc class mounts a tiny tmpfs: run the suite as root (CI does)")
    classes = ["ds-config", "trainer-flags", "path-escape", "non-empty-destination", "sigkill-save", "sigkill-job",
               "corruption", "enospc", "peers", "snapshot-dir", "convert-into-ckpt", "non-regular", "run-flags"]
    rc = fault_campaign.main(["--seed", "1", "--classes", ",".join(classes), "--kills", "30", "--job-kills", "10",
                              "--corruptions", "12", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    want = {"sigkill-job": 10, "corruption": 12, "enospc": 9, "peers": 4, "snapshot-dir": 4, "convert-into-ckpt": 4,
            "non-regular": 3, "run-flags": 5}
    for c, n in want.items():
        assert f"| {c} | {n} | {n} | 0 | 0 | 0 |" in out, out
    for c in classes:
        assert f"| {c} | " in out, (c, out)
    assert rc == 0, out


@pytest.mark.timeout(600)
def test_campaign_attacker_classes(tmp_path, capsys):
    """Another local user or a forger (issue 19): every trial refused, nothing lost, no hang, no
    traceback. The standby-handoff class runs its attacker as ``nobody`` (root needed: CI is root)."""
    classes = ["snapshot-server", "forged-table", "peer-sender"] + (["standby-handoff"] if os.getuid() == 0 else [])
    rc = fault_campaign.main(["--seed", "1", "--classes", ",".join(classes), "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    want = {"snapshot-server": 14, "forged-table": 10, "peer-sender": 3, "standby-handoff": 2}
    for c in classes:
        n = want[c]
        assert f"| {c} | {n} | {n} | 0 | 0 | 0 |" in out, out
    assert rc == 0, out
