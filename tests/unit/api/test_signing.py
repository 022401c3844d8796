"""What the API signs: download URLs, good until they expire and only for the path and expiry they were made
for; JWTs, good until they expire and only under the key that minted them."""

from __future__ import annotations

import pytest

from services.api.signing import check, mint_jwt, read_jwt, sign

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


def test_a_jwt_names_its_token_until_it_expires_and_only_under_its_key():
    token = mint_jwt(KEY, "ab" * 32, "alice", "flywheel@host", 3600)
    claims = read_jwt(KEY, token)
    assert (claims["owner"], claims["sub"], claims["org_id"]) == ("ab" * 32, "tml:user:alice", "flywheel@host")
    assert claims["exp"] - claims["iat"] == 3600 and token.startswith("eyJ")  # what the SDK takes for a JWT
    with pytest.raises(ValueError, match="not one this server minted"):
        read_jwt(bytes(32), token)
    with pytest.raises(ValueError, match="has expired"):
        read_jwt(KEY, mint_jwt(KEY, "ab" * 32, "alice", "flywheel@host", 60, now=1_000_000))
    head, body, sig = token.split(".")
    with pytest.raises(ValueError, match="not one this server minted"):
        read_jwt(KEY, f"{head}.{body[:-2]}AA.{sig}")
