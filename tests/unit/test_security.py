"""Fleet call tokens, security configuration files, HTTP API keys, and what mDNS announces."""

from __future__ import annotations

import dataclasses
import time

import pytest

from coordinator.api.access import ApiKeys, bearer_key, cache_scope
from coordinator.settings import CoordinatorSettings, read_api_keys
from fleet_common.discovery import WorkerAd, encode_txt
from fleet_common.security import MAX_SKEW_S, Security, SecurityError, TokenError, check_token, make_token, read_secret
from fleet_common.settings import SecuritySettings

SECRET = b"correct horse battery staple"
FORWARD = "/fleet.v1.Stage/Forward"


def test_token_round_trip_and_format():
    token = make_token(SECRET, FORWARD)
    scheme, rest = token.split(" ")
    ts, nonce, mac = rest.split(".")
    assert scheme == "fleet-hmac" and abs(int(ts) - time.time()) < 5 and len(nonce) == 16 and len(mac) == 64
    check_token(SECRET, FORWARD, token)
    assert make_token(SECRET, FORWARD) != token  # a fresh nonce each call


def test_token_matches_hmac_sha256_of_method_ts_nonce():
    import hashlib
    import hmac

    token = make_token(SECRET, FORWARD, now=1_700_000_000, nonce="abcdef0123456789")
    expected = hmac.new(SECRET, f"{FORWARD}\n1700000000\nabcdef0123456789".encode(), hashlib.sha256).hexdigest()
    assert token == f"fleet-hmac 1700000000.abcdef0123456789.{expected}"


@pytest.mark.parametrize("value, words", [
    (None, "carried none"),
    ("", "carried none"),
    ("Bearer abc", "malformed"),
    ("fleet-hmac 1.2.3", "malformed"),
    (make_token(SECRET, FORWARD).upper(), "malformed"),
    (make_token(b"another secret", FORWARD), "differs"),
    (make_token(SECRET, "/fleet.v1.Stage/Info"), "differs"),  # a token is bound to its method
    (make_token(SECRET, FORWARD) + " ", "malformed"),
])
def test_bad_tokens_are_refused_with_a_reason(value, words):
    with pytest.raises(TokenError, match=words):
        check_token(SECRET, FORWARD, value)


def test_clock_skew_limit():
    now = 1_800_000_000.0
    for skew in (-MAX_SKEW_S + 1, 0, MAX_SKEW_S - 1):
        check_token(SECRET, FORWARD, make_token(SECRET, FORWARD, now=now + skew), now=now)
    with pytest.raises(TokenError, match="behind .* clock"):
        check_token(SECRET, FORWARD, make_token(SECRET, FORWARD, now=now - MAX_SKEW_S - 2), now=now)
    with pytest.raises(TokenError, match="ahead of .* clock"):
        check_token(SECRET, FORWARD, make_token(SECRET, FORWARD, now=now + MAX_SKEW_S + 2), now=now)


def test_secret_file_is_stripped_and_must_hold_something(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  s3cret \n")
    assert read_secret(path) == b"s3cret"
    assert Security.load(path).secret == b"s3cret"
    path.write_text(" \n\t")
    with pytest.raises(SecurityError, match="empty"):
        Security.load(path)
    with pytest.raises(SecurityError, match="cannot read"):
        Security.load(tmp_path / "missing")


def test_tls_files_are_checked(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(SecurityError, match="go together"):
        Security.load(tls_cert=junk)
    with pytest.raises(SecurityError, match="needs --tls-cert"):
        Security.load(tls_ca=junk)
    with pytest.raises(SecurityError, match="not a PEM certificate"):
        Security.load(tls_cert=junk, tls_key=junk)


def test_child_workers_get_paths_never_the_secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cret")
    security = Security.load(path)
    assert security.cli_args() == ["--secret", str(path.resolve())]
    assert "s3cret" not in repr(security) and Security().cli_args() == []
    assert security.describe() == "HMAC tokens, plaintext" and Security().describe() == "no authentication, plaintext"


def test_api_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# fleet API keys\nkey-one\n\n  key-two  # Bob\n")
    assert read_api_keys(path) == ["key-one", "key-two"]
    path.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no key"):
        read_api_keys(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_api_keys(tmp_path / "missing")


def test_api_key_check():
    keys = ApiKeys(app=None, keys=["key-one", "key-two"])
    assert keys.refusal("Bearer key-two") is None and keys.refusal("bearer  key-one ") is None
    for header, words in ((None, "requires an API key"), ("key-one", "requires an API key"),
                          ("Bearer ", "requires an API key"), ("Bearer key-three", "invalid API key"),
                          ("Basic key-one", "requires an API key")):
        refusal = keys.refusal(header)
        assert refusal is not None and words in refusal.message
        assert refusal.status == 401 and refusal.body()["error"] == {
            "message": refusal.message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


def test_bearer_key_and_cache_scope():
    """One parse of ``Authorization: Bearer KEY`` serves the key check and the prefix cache's scope: the
    scope is a digest of the key (never the key), the same for the same key however it is spelt."""
    assert bearer_key("Bearer k1") == bearer_key("bearer  k1 ") == bearer_key(" BEARER k1") == "k1"
    for value in (None, "", "Bearer", "Bearer  ", "Basic k1", "k1"):
        assert bearer_key(value) is None and cache_scope(value) == "", value
    scope = cache_scope("Bearer k1")
    assert scope == cache_scope("bearer  k1 ") != cache_scope("Bearer k2")
    assert len(scope) == 32 and "k1" not in scope and int(scope, 16) >= 0


def test_security_settings_are_one_mixin(tmp_path):
    """The worker's and the coordinator's settings take --secret/--tls-* from the same mixin, which
    loads them at validation (an unusable file is a validation error naming the flag)."""
    from pydantic import ValidationError

    from worker.settings import WorkerSettings

    secret = tmp_path / "secret"
    secret.write_text("correct horse\n")
    for cls, required in ((WorkerSettings, {"shard": 0, "model": tmp_path}), (CoordinatorSettings, {"model": tmp_path})):
        assert issubclass(cls, SecuritySettings)
        assert cls.model_fields["secret"] is not None and cls.model_fields["tls_ca"].description
        assert cls(**required).security.describe() == "no authentication, plaintext"
        loaded = cls(**required, secret=secret).security
        assert loaded.secret == b"correct horse" and loaded.describe() == "HMAC tokens, plaintext"
        with pytest.raises(ValidationError, match="--tls-cert and --tls-key go together"):
            cls(**required, tls_cert=secret)
    keys = CoordinatorSettings(model=tmp_path, secret=secret, api_keys="a, b,a").allowed_api_keys
    assert keys == ("a", "b"), "the coordinator's own validator still runs beside the mixin's"


def test_mdns_announcement_carries_no_secret():
    # everything a worker announces comes from WorkerAd; it has no field that could hold key material
    names = {f.name for f in dataclasses.fields(WorkerAd)}
    assert not {n for n in names if any(w in n for w in ("secret", "key", "token", "cert", "tls", "auth"))}
    ad = WorkerAd(1, 2, 19, 30, "ab" * 32, 3, "SmolLM2", "0123456789ab", 50051)
    txt = encode_txt(ad)
    assert set(txt) == {"stage", "stages", "layers", "manifest", "proto", "model", "id"}
