"""``--rdzv-endpoint`` lists for the etcd-v2 rendezvous (elastic/rdzv_args.py, elastic/etcd_rdzv.py):
pure checks of the list syntax, the member order a node's client tries, and the missing-client
message."""
from __future__ import annotations

import pytest

from elastor_ds.errors import ConfigError


def test_endpoint_lists_are_for_etcd_v2_and_the_own_member_goes_first(monkeypatch):
    from elastor_ds.elastic.etcd_rdzv import member_order
    from elastor_ds.elastic.rdzv_args import check_client, check_endpoints
    ok = lambda h, p: None   # noqa: E731 - no name lookups in this test
    assert check_endpoints("e0:2379", "c10d", ok) == (("e0", 2379),)
    assert check_endpoints(" e0:2379, e1:2379 ,[::1]:2380", "etcd-v2", ok) == (("e0", 2379), ("e1", 2379),
                                                                               ("::1", 2380))
    for text, backend, msg in (("e0:2379,e1:2379", "etcd", "is for --rdzv-backend etcd-v2"),
                               ("e0:2379,,e1:2379", "etcd-v2", "an empty entry"),
                               ("e0:2379,e1", "etcd-v2", "--rdzv-endpoint 'e1': expected HOST:PORT")):
        with pytest.raises(ConfigError, match=msg):
            check_endpoints(text, backend, ok)
    members = (("10.0.0.1", 2379), ("10.0.0.2", 2379), ("10.0.0.3", 2379))
    assert member_order(members, "10.0.0.2") == (("10.0.0.2", 2379), ("10.0.0.1", 2379), ("10.0.0.3", 2379))
    assert member_order(members, None) == members and member_order(members, "10.9.9.9") == members
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "etcd" else real(name, *a))
    with pytest.raises(ConfigError, match=r"the etcd client is not installed \(no module 'etcd'\); pip install "
                                          r"python-etcd==0\.4\.5"):
        check_client("etcd-v2")
    check_client("c10d")
