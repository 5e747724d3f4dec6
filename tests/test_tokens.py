"""Session tokens: signed, bound to one session and the operate permission, expiring."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from itsdangerous import URLSafeSerializer
from typer.testing import CliRunner

from dex_tasks import (
    ConfigurationError,
    DexError,
    ForbiddenSessionError,
    InvalidArgumentError,
    InvalidTokenError,
    issue_token,
    tokens,
    verify_token,
)
from dex_tasks.ops.cli import app as cli_app
from tests.helpers import free_port, start_process

SECRET = "a-long-test-secret-0123456789"


def test_a_token_verifies_for_its_session_with_its_claims() -> None:
    now = 1_000_000.0
    token = issue_token(SECRET, "s1", ttl_seconds=60, approver="alice", now=now)
    claims = verify_token(SECRET, token, "s1", now=now + 59)
    assert claims.session_id == "s1"
    assert claims.approver == "alice"
    assert claims.permissions == (tokens.OPERATE,)
    assert claims.expires_at == now + 60
    assert verify_token(SECRET, issue_token(SECRET, "s1"), "s1").approver is None


def test_expired_token_is_invalid() -> None:
    token = issue_token(SECRET, "s1", ttl_seconds=60, now=1000.0)
    verify_token(SECRET, token, "s1", now=1059.9)
    with pytest.raises(InvalidTokenError, match="expired"):
        verify_token(SECRET, token, "s1", now=1060.0)


def test_forged_token_is_invalid() -> None:
    forged = issue_token("someone-elses-secret-key", "s1")
    with pytest.raises(InvalidTokenError):
        verify_token(SECRET, forged, "s1")
    # The same secret used for another purpose (another salt) does not make a token either.
    other_use = URLSafeSerializer(SECRET).dumps({"sid": "s1", "perm": ["operate"],
                                                 "exp": time.time() + 60})
    with pytest.raises(InvalidTokenError):
        verify_token(SECRET, str(other_use), "s1")


def test_tampered_token_is_invalid() -> None:
    token = issue_token(SECRET, "s1", ttl_seconds=60, approver="alice")
    payload, signature = token.rsplit(".", 1)
    # Given the payload rewritten to another session and a later expiry, old signature kept
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims.update(sid="s2", exp=claims["exp"] + 10**6)
    rewritten = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    for bad in (f"{rewritten}.{signature}",
                # The first character: every one of its bits is signature (the last one's low
                # bits are base64 padding, so changing only those changes nothing).
                f"{payload}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}",
                token[:-3], f"{payload}.", "not-a-token", "a.b.c", " "):
        with pytest.raises(InvalidTokenError):
            verify_token(SECRET, bad, "s2" if bad.startswith(rewritten) else "s1")


def test_missing_token_is_invalid() -> None:
    for missing in ("", None):
        with pytest.raises(InvalidTokenError):
            verify_token(SECRET, missing, "s1")  # type: ignore[arg-type]


def test_token_of_another_session_is_forbidden_not_invalid() -> None:
    token = issue_token(SECRET, "s1")
    with pytest.raises(ForbiddenSessionError, match="another session"):
        verify_token(SECRET, token, "s2")
    with pytest.raises(ForbiddenSessionError):
        verify_token(SECRET, token, "s1 ")
    # A forbidden token is still a DexError, and not mistaken for an invalid one.
    assert issubclass(ForbiddenSessionError, DexError)
    assert not issubclass(ForbiddenSessionError, InvalidTokenError)
    assert tokens.ForbiddenSessionError is ForbiddenSessionError


def test_a_view_token_reads_but_does_not_operate() -> None:
    token = issue_token(SECRET, "s1", approver="dora", permissions=(tokens.VIEW,))
    with pytest.raises(ForbiddenSessionError, match="operate"):
        verify_token(SECRET, token, "s1")
    claims = verify_token(SECRET, token, "s1", permission=tokens.VIEW)
    assert claims.permissions == ("view",) and claims.strongest_permission == "view"
    # operate implies view; a token with neither grants nothing.
    assert verify_token(SECRET, issue_token(SECRET, "s1"), "s1", permission=tokens.VIEW) \
        .strongest_permission == "operate"
    with pytest.raises(ForbiddenSessionError, match="view"):
        verify_token(SECRET, issue_token(SECRET, "s1", permissions=()), "s1",
                     permission=tokens.VIEW)
    # A permission this release does not know (from a later one, say) grants nothing here.
    serializer = URLSafeSerializer(SECRET, salt=tokens._SALT)
    future = str(serializer.dumps({"sid": "s1", "perm": ["admin"], "exp": time.time() + 60}))
    with pytest.raises(ForbiddenSessionError):
        verify_token(SECRET, future, "s1", permission=tokens.VIEW)


def test_tokens_issued_by_the_previous_release_still_verify() -> None:
    # Printed by the previous release's issue_token(SECRET, "s1", approver="alice") (and without
    # an approver), expiring at 2100-01-01T00:00:00Z.
    old_named = ("eyJzaWQiOiJzMSIsInBlcm0iOlsib3BlcmF0ZSJdLCJleHAiOjQxMDI0NDQ4MDAsImFwciI6ImFs"
                 "aWNlIn0.78JchwmRu2hZVgvE0vjbnNDSgj0")
    old_unnamed = ("eyJzaWQiOiJzMSIsInBlcm0iOlsib3BlcmF0ZSJdLCJleHAiOjQxMDI0NDQ4MDB9."
                   "_-Ib0MSDDAoXVkEBpxRyQreC-Mg")
    claims = verify_token(SECRET, old_named, "s1")
    assert (claims.session_id, claims.approver, claims.permissions, claims.expires_at,
            claims.all_sessions) == ("s1", "alice", ("operate",), 4102444800.0, False)
    assert verify_token(SECRET, old_unnamed, "s1").approver is None
    with pytest.raises(ForbiddenSessionError):
        verify_token(SECRET, old_named, "s2")
    # A session token issued now has exactly the old payload: an older API accepts it too.
    assert issue_token(SECRET, "s1", ttl_seconds=100, approver="alice",
                       now=4102444800 - 100) == old_named


def test_an_operator_token_covers_every_session_and_no_session_id_can_pose_as_one() -> None:
    operator = issue_token(SECRET, None, approver="olga", all_sessions=True)
    for session in ("s1", "s2", "*", "all"):
        claims = verify_token(SECRET, operator, session)
        assert claims.all_sessions and claims.session_id is None and claims.approver == "olga"
    assert verify_token(SECRET, operator, None).all_sessions  # None: every session
    view_operator = issue_token(SECRET, None, permissions=["view"], all_sessions=True)
    verify_token(SECRET, view_operator, None, permission=tokens.VIEW)
    with pytest.raises(ForbiddenSessionError, match="operate"):
        verify_token(SECRET, view_operator, "s1")
    # Session tokens, whatever their session id says, are for that one session only.
    for session in ("*", "all", "true", "%", ""):
        if session:
            token = issue_token(SECRET, session)
            assert not verify_token(SECRET, token, session).all_sessions
            with pytest.raises(ForbiddenSessionError, match="operator token"):
                verify_token(SECRET, token, None)
            with pytest.raises(ForbiddenSessionError, match="another session"):
                verify_token(SECRET, token, "s1")
    # A signed payload with both scopes, or an operator claim that is not the boolean true,
    # is refused as malformed rather than read either way.
    serializer = URLSafeSerializer(SECRET, salt=tokens._SALT)
    exp = time.time() + 60
    for payload in ({"sid": "s1", "all": True, "perm": ["operate"], "exp": exp},
                    {"all": 1, "perm": ["operate"], "exp": exp},
                    {"all": "true", "perm": ["operate"], "exp": exp},
                    {"all": False, "perm": ["operate"], "exp": exp},
                    {"perm": ["operate"], "exp": exp}):
        with pytest.raises(InvalidTokenError, match="shape"):
            verify_token(SECRET, str(serializer.dumps(payload)), "s1")
    with pytest.raises(InvalidArgumentError, match="session_id"):
        issue_token(SECRET, "s1", all_sessions=True)
    with pytest.raises(InvalidArgumentError, match="session_id"):
        issue_token(SECRET, None)


def test_a_signed_payload_of_the_wrong_shape_is_invalid() -> None:
    serializer = URLSafeSerializer(SECRET, salt=tokens._SALT)
    for payload in ([1, 2], {"sid": 5, "perm": [], "exp": 1e12},
                    {"sid": "s1", "perm": "operate", "exp": 1e12},
                    {"sid": "s1", "perm": ["operate"], "exp": "never"},
                    {"sid": "s1", "perm": ["operate"], "exp": float("nan")}):
        with pytest.raises(InvalidTokenError, match="shape"):
            verify_token(SECRET, str(serializer.dumps(payload)), "s1")


def test_bad_issue_arguments_name_the_field() -> None:
    for kwargs, field in (({"ttl_seconds": 0}, "ttl_seconds"), ({"ttl_seconds": -5}, "ttl"),
                          ({"ttl_seconds": float("nan")}, "ttl"), ({"ttl_seconds": "9"}, "ttl"),
                          ({"approver": ""}, "approver"), ({"approver": "x" * 201}, "approver")):
        with pytest.raises(InvalidArgumentError, match=field):
            issue_token(SECRET, "s1", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="session_id"):
        issue_token(SECRET, "")
    for permissions in (["ad min"], "operate", ["view", "wr/ite"], [""]):
        with pytest.raises(InvalidArgumentError, match="permissions"):
            issue_token(SECRET, "s1", permissions=permissions)


def test_a_named_permission_is_signed_in_and_grants_nothing_else() -> None:
    # A policy's approver_permission ("payments.approve") travels in the signed claims
    token = issue_token(SECRET, "s1", permissions=["view", "payments.approve"])
    claims = verify_token(SECRET, token, "s1", permission="view")
    assert claims.permissions == ("view", "payments.approve")
    assert claims.allows("payments.approve") and not claims.allows("operate")
    with pytest.raises(ForbiddenSessionError, match="operate"):
        verify_token(SECRET, token, "s1")
    with pytest.raises(ConfigurationError, match="DEX_SECRET_KEY"):
        issue_token("", "s1")


def test_cli_prints_a_token_signed_with_the_configured_secret(env: dict[str, str]) -> None:
    result = CliRunner().invoke(cli_app, ["token", "s1", "--ttl", "120", "--approver", "alice"],
                                env=env)
    assert result.exit_code == 0, result.output
    token = result.stdout.strip()
    claims = verify_token(env["DEX_SECRET_KEY"], token, "s1")
    assert claims.approver == "alice"
    assert 100 < claims.expires_at - time.time() <= 120
    assert env["DEX_SECRET_KEY"] not in result.output
    assert "warning" not in result.output

    bad = CliRunner().invoke(cli_app, ["token", "s1", "--ttl", "0"], env=env)
    # The option as typed, not the library's parameter name
    assert bad.exit_code == 2 and "'--ttl'" in bad.output and "ttl_seconds" not in bad.output


def test_cli_refuses_to_sign_without_a_secret(env: dict[str, str]) -> None:
    # There is no default secret: a public one would let anyone forge tokens.
    unset = {**env, "DEX_SECRET_KEY": None}
    result = CliRunner().invoke(cli_app, ["token", "s1"], env=unset)  # type: ignore[dict-item]
    assert result.exit_code == 2
    assert "DEX_SECRET_KEY is not set" in result.stderr
    assert result.stdout == ""


def test_api_refuses_to_serve_without_a_secret(env: dict[str, str], tmp_path: Path) -> None:
    # Given `dex-tasks api` started with no DEX_SECRET_KEY
    unset = {k: v for k, v in env.items() if k != "DEX_SECRET_KEY"}
    port = free_port()
    proc = start_process(["api", "--port", str(port)], unset, tmp_path / "api.log")
    # Then it exits at once with an error that says what to set, having served nothing
    assert proc.wait(60) == 2
    log = (tmp_path / "api.log").read_text()
    assert "DEX_SECRET_KEY is not set" in log
    assert "Uvicorn running" not in log


def test_cli_issues_view_and_operator_tokens(env: dict[str, str]) -> None:
    secret = env["DEX_SECRET_KEY"]
    view = CliRunner().invoke(cli_app, ["token", "s1", "--permission", "view",
                                        "--approver", "dora"], env=env)
    assert view.exit_code == 0, view.output
    claims = verify_token(secret, view.stdout.strip(), "s1", permission=tokens.VIEW)
    assert (claims.permissions, claims.approver) == (("view",), "dora")
    with pytest.raises(ForbiddenSessionError):
        verify_token(secret, view.stdout.strip(), "s1")

    operator = CliRunner().invoke(cli_app, ["token", "--all-sessions", "--approver", "olga",
                                            "--ttl", "600"], env=env)
    assert operator.exit_code == 0, operator.output
    claims = verify_token(secret, operator.stdout.strip(), None)
    assert claims.all_sessions and claims.permissions == ("operate",)
    assert 500 < claims.expires_at - time.time() <= 600

    for args, message in ((["token"], "exactly one"),
                          (["token", "s1", "--all-sessions"], "exactly one"),
                          (["token", "s1", "--permission", "admin"], "admin")):
        bad = CliRunner().invoke(cli_app, args, env=env)
        assert bad.exit_code != 0 and message in bad.output, (args, bad.output)
