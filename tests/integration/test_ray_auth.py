"""Ray's token authentication as kvledger sets it up: on by default, the token made once where Ray reads it.

That a cluster ``kvledger up`` started refuses a driver without the token is checked on real processes in
``test_cluster_cli.py``; here, the token file itself.
"""
from __future__ import annotations

import stat

import pytest

from kvledger.coordinator.ray_env import ENV_DEFAULTS, auth_token_path, ensure_auth_token


@pytest.fixture
def token_file(tmp_path, monkeypatch):
    path = tmp_path / "ray" / "auth_token"
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    return path


def test_token_auth_is_the_default_mode():
    assert ENV_DEFAULTS["RAY_AUTH_MODE"] == "token"


def test_the_token_is_made_once_readable_by_its_owner_only(token_file):
    assert auth_token_path() == token_file and not token_file.exists()
    assert ensure_auth_token() == token_file
    token = token_file.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert ensure_auth_token() == token_file and token_file.read_text() == token, "never rewritten"


def test_a_token_given_by_env_or_auth_off_needs_no_file(token_file, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "f" * 64)
    assert auth_token_path() is None and ensure_auth_token() is None
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ensure_auth_token() is None and not token_file.exists()


def test_an_empty_token_file_is_a_clear_error(token_file):
    token_file.parent.mkdir(parents=True)
    token_file.write_text("")
    with pytest.raises(ValueError, match="is empty: remove it"):
        ensure_auth_token()
    assert token_file.read_text() == ""
