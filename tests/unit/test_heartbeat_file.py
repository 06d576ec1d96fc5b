"""A worker's heartbeat file is written without following a link: its folder is this user's alone
(``elastor_ds.elastic.private``), but a link there must still not make the heartbeat overwrite
another file. Oracle: the link's target, byte for byte, and the heartbeat the controller reads."""
from __future__ import annotations

import os

from elastor_ds.elastic.worker import ElasticWorker


def test_a_link_at_the_heartbeats_temporary_name_is_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    hb = tmp_path / "heartbeat_0"
    os.symlink(victim, str(hb) + ".tmp")
    w = ElasticWorker.__new__(ElasticWorker)
    w.heartbeat_file = str(hb)
    w.heartbeat(3)                       # refused (logged): no heartbeat rather than a write through the link
    assert victim.read_text() == "precious\n"
    assert not hb.exists()
    os.unlink(str(hb) + ".tmp")
    w.heartbeat(4, last=True)
    assert hb.read_text().split()[0] == "4" and hb.read_text().split()[2] == "last"
    assert oct(os.stat(hb).st_mode & 0o777) == "0o600"
