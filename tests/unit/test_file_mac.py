"""The keyed digest of peer-copied files (checkpoint.auth.FileMac): GMAC by default, HMAC-SHA256
without the cryptography package; a receiver checks either; any changed byte, name, step, origin,
key or nonce fails; every GMAC tag has a fresh nonce."""
import hashlib
import hmac
import os

import pytest

from elastor_ds.checkpoint import auth
from elastor_ds.checkpoint.auth import FileMac, file_mac

KEY = bytes(range(32))
DATA = os.urandom(3 * (1 << 20) + 17)   # more than one MAC piece, not a multiple of one


def _check(tag, data=DATA, key=KEY, origin="hostA-dir", step="step_000000005", rel="data_00000.safetensors"):
    m = FileMac(key, origin, step, rel, tag=tag)
    m.update(data)
    return m.matches(tag)


@pytest.mark.parametrize("scheme", ["gmac", "hmac"])
def test_tag_checks_and_any_change_fails(scheme):
    if scheme == "gmac" and not auth.GMAC_AVAILABLE:
        pytest.skip("cryptography not installed")
    tag = file_mac(KEY, "hostA-dir", "step_000000005", "data_00000.safetensors", DATA, scheme=scheme)
    assert tag.startswith("g1.") == (scheme == "gmac")
    assert _check(tag)
    flipped = bytearray(DATA)
    flipped[len(DATA) // 2] ^= 1
    assert not _check(tag, data=bytes(flipped))
    assert not _check(tag, data=DATA[:-1])
    assert not _check(tag, key=bytes(32))
    assert not _check(tag, origin="hostB-dir")
    assert not _check(tag, step="step_000000006")
    assert not _check(tag, rel="data_00001.safetensors")


def test_hmac_tag_is_the_previous_format():
    """Without GMAC the tag is HMAC-SHA256 over the same fields as before (old senders interoperate)."""
    want = hmac.new(KEY, b"peer\nhostA-dir\nstep_000000005\ndata_00000.safetensors\n" + DATA, hashlib.sha256).hexdigest()
    assert file_mac(KEY, "hostA-dir", "step_000000005", "data_00000.safetensors", DATA, scheme="hmac") == want


@pytest.mark.skipif(not auth.GMAC_AVAILABLE, reason="cryptography not installed")
def test_gmac_nonce_is_fresh_and_bound():
    a = file_mac(KEY, "o", "step_000000001", "f", DATA)
    b = file_mac(KEY, "o", "step_000000001", "f", DATA)
    assert a != b and a.split(".")[1] != b.split(".")[1]   # a new nonce per tag
    assert _check(a, origin="o", step="step_000000001", rel="f") and _check(b, origin="o", step="step_000000001", rel="f")
    nonce, tag = a.split(".")[1:]
    other = f"g1.{'0' * 24}.{tag}"   # the same tag under another nonce
    assert not _check(other, origin="o", step="step_000000001", rel="f")
    assert not _check(f"g1.{nonce}", origin="o", step="step_000000001", rel="f")   # malformed


def test_gmac_tag_without_cryptography_never_matches(monkeypatch):
    monkeypatch.setattr(auth, "GMAC_AVAILABLE", False)
    assert file_mac(KEY, "o", "step_000000001", "f", DATA).startswith("g1.") is False   # falls back to HMAC
    assert not _check("g1." + "0" * 24 + "." + "0" * 32, origin="o", step="step_000000001", rel="f")


def test_empty_file():
    for scheme in ("gmac", "hmac"):
        tag = file_mac(KEY, "o", "step_000000001", "f", b"", scheme=scheme)
        assert _check(tag, data=b"", origin="o", step="step_000000001", rel="f")
