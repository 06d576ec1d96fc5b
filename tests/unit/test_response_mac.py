"""The snapshot server's answer MAC (checkpoint.auth.response_mac / response_mac_matches): GMAC with
a fresh nonce under a key derived for answers only, checked against an independent AES-GCM
computation; HMAC-SHA256 (the previous format) still checks; any changed field or byte fails; a
tag made with the peer-copy key over the same bytes is not an answer tag."""
import hashlib
import hmac
import os

import pytest

from elastor_ds.checkpoint import auth
from elastor_ds.checkpoint.auth import response_mac, response_mac_matches

KEY = bytes(range(32))
BODY = os.urandom(2 * (1 << 20) + 5)
FIELDS = dict(nonce="ab" * 16, status=206, rng="bytes 0-2097156/9000000", size="9000000")
gmac = pytest.mark.skipif(not auth.GMAC_AVAILABLE, reason="cryptography not installed")


def _ok(tag, body=BODY, key=KEY, **over):
    f = dict(FIELDS, **over)
    return response_mac_matches(key, f["nonce"], f["status"], f["rng"], f["size"], [body[:1000], body[1000:]], tag)


def _head(**over):
    f = dict(FIELDS, **over)
    return b"resp\n" + "".join(f"{v}\n" for v in (f["nonce"], f["status"], f["rng"], f["size"])).encode()


@gmac
def test_gmac_answer_tag_is_aes_gcm_under_the_answer_key():
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    tag = response_mac(KEY, FIELDS["nonce"], FIELDS["status"], FIELDS["rng"], FIELDS["size"], [BODY])
    prefix, nonce, mac = tag.split(".")
    assert prefix == "g1" and len(nonce) == 24 and len(mac) == 32
    answer_key = hmac.new(KEY, b"elastor-ds snapshot-response gmac v1", hashlib.sha256).digest()
    # GMAC = AES-GCM with an empty plaintext: the output is the 16-byte tag over the associated data
    want = AESGCM(answer_key).encrypt(bytes.fromhex(nonce), b"", _head() + BODY)
    assert mac == want.hex()
    assert _ok(tag)


@pytest.mark.parametrize("scheme", ["gmac", "hmac"])
def test_any_changed_field_or_byte_fails(scheme):
    if scheme == "gmac" and not auth.GMAC_AVAILABLE:
        pytest.skip("cryptography not installed")
    tag = response_mac(KEY, FIELDS["nonce"], FIELDS["status"], FIELDS["rng"], FIELDS["size"], [BODY], scheme=scheme)
    assert tag.startswith("g1.") == (scheme == "gmac") and _ok(tag)
    flipped = bytearray(BODY)
    flipped[12345] ^= 0x10
    assert not _ok(tag, body=bytes(flipped))
    assert not _ok(tag, body=BODY[:-1])
    assert not _ok(tag, key=bytes(32))
    assert not _ok(tag, nonce="cd" * 16)
    assert not _ok(tag, status=200)
    assert not _ok(tag, rng="bytes 1-2097157/9000000")
    assert not _ok(tag, size="9000001")


def test_hmac_answer_tag_is_the_previous_format():
    want = hmac.new(KEY, _head() + BODY, hashlib.sha256).hexdigest()
    assert response_mac(KEY, FIELDS["nonce"], FIELDS["status"], FIELDS["rng"], FIELDS["size"], [BODY],
                        scheme="hmac") == want
    assert _ok(want)


@gmac
def test_answer_tags_are_fresh_and_not_peer_copy_tags():
    a = response_mac(KEY, FIELDS["nonce"], FIELDS["status"], FIELDS["rng"], FIELDS["size"], [BODY])
    b = response_mac(KEY, FIELDS["nonce"], FIELDS["status"], FIELDS["rng"], FIELDS["size"], [BODY])
    assert a.split(".")[1] != b.split(".")[1] and _ok(a) and _ok(b)
    assert not _ok(f"g1.{'0' * 24}.{a.split('.')[2]}")   # the same tag under another nonce
    assert not _ok(a[:-1]) and not _ok("") and not _ok("g1..")
    # a malformed tag from the wire is a failed check, never an exception
    assert not _ok("g1." + "zz" * 12 + "." + "0" * 32) and not _ok("g1." + "0" * 24 + "." + "zz" * 16)
    assert not _ok("g1." + "0" * 24 + ".." + "0" * 31) and not _ok("\u00e9" * 40)
    # a tag made with the peer-copy key over the very same bytes (same nonce) is refused: one key per use
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    copy_key = hmac.new(KEY, b"elastor-ds peer-copy gmac v1", hashlib.sha256).digest()
    nonce = bytes.fromhex(a.split(".")[1])
    forged = f"g1.{nonce.hex()}.{AESGCM(copy_key).encrypt(nonce, b'', _head() + BODY).hex()}"
    assert not _ok(forged)
