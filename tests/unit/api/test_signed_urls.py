"""Signed download URLs: good until they expire, and only for the path and expiry they were made for."""

from __future__ import annotations

from services.api.signed_urls import check, sign

KEY = bytes(range(32))
PATH = "s%3Atrain%3A0/final/adapter_model.safetensors"


def test_a_signed_url_is_good_until_it_expires():
    expires, sig = sign(KEY, PATH, 3600, now=1_000_000)
    assert expires == 1_003_600
    assert check(KEY, PATH, expires, sig, now=1_003_599) is None
    assert "expired" in check(KEY, PATH, expires, sig, now=1_003_600)


def test_a_signature_is_refused_for_another_file_a_later_expiry_or_another_key():
    expires, sig = sign(KEY, PATH, 3600, now=1_000_000)
    for why in (check(KEY, PATH.replace("final", "other"), expires, sig, now=1_000_000),
                check(KEY, PATH, expires + 86400, sig, now=1_000_000),
                check(bytes(32), PATH, expires, sig, now=1_000_000),
                check(KEY, PATH, expires, sig[:-1] + ("0" if sig[-1] != "0" else "1"), now=1_000_000)):
        assert why is not None and "signature does not match" in why
