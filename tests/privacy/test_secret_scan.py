"""The secret screening's rules (onlinerl/secret_scan.py): every format it knows is found where it is, in real code
shapes; placeholders, identifiers and ordinary code are not findings; what a finding carries never holds the text."""

from __future__ import annotations

import pytest

from onlinerl.secret_scan import describe, kinds, scan, scan_fields, shannon_entropy
from tests.privacy_corpus import FORMATS, seeded_secrets


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_each_format_is_found_exactly_where_it_is(kind: str) -> None:
    for _kind, secret, line in [s for s in seeded_secrets(11, 4) if s[0] == kind]:
        code = f"import os\n\n{line}\nprint('done')\n"
        found = scan(code)
        assert [f.kind for f in found] == [kind], (line, found)
        assert code[found[0].start : found[0].end] == secret


def test_the_rules_cover_at_least_the_issue_s_formats() -> None:
    wanted = {"aws_access_key_id", "github_token", "gitlab_token", "slack_token", "private_key", "jwt"}
    assert wanted | {"connection_string_password", "high_entropy_assignment"} <= set(kinds())
    assert set(FORMATS) <= set(kinds())


@pytest.mark.parametrize(
    "code",
    [
        'url = "postgres://user:password@localhost/db"',  # documentation placeholders
        'DATABASE_URL = "mysql://${DB_USER}:${DB_PASSWORD}@db/app"',
        'SECRET_KEY = "django-insecure-change-me"',  # low entropy
        'token_type = "bearer_token_authentication"',  # an identifier chain
        'password = os.environ["DB_PASSWORD"]',
        'api_key = get_secret("payments/api-key")',
        'checksum = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"',  # no credential name
        "def token_for(user):\n    return hmac.new(key, user.encode(), 'sha256').hexdigest()",
    ],
)
def test_ordinary_code_is_not_a_finding(code: str) -> None:
    assert scan(code) == []


def test_a_connection_string_with_a_real_looking_password_is() -> None:
    code = 'DSN = "postgresql://svc:Xk2v9Lq7Pz@10.0.0.5:5432/prod"'
    [f] = scan(code)
    assert (f.kind, code[f.start : f.end]) == ("connection_string_password", "Xk2v9Lq7Pz")


def test_an_unterminated_private_key_is_found_to_the_end() -> None:
    code = "KEY = '''-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ"
    [f] = scan(code)
    assert f.kind == "private_key" and f.end == len(code)


def test_what_a_finding_says_never_holds_the_secret() -> None:
    _kind, secret, line = seeded_secrets(5, 1)[0]
    findings = scan_fields([("prompt", line), ("completion", "")])
    message = describe(findings)
    assert secret not in message and "in the prompt at characters" in message
    assert all(secret not in repr(f) for f in findings)


def test_entropy_separates_random_from_words() -> None:
    assert shannon_entropy("aaaaaaaaaaaaaaaa") == 0
    assert shannon_entropy("hello_world_example") < 3.5 < shannon_entropy("9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c")


def test_large_hostile_input_stays_linear() -> None:
    """A prompt built to make a regex backtrack (long runs of key characters after every hint) scans in time."""
    import time

    hostile = ("AKIA" + "A" * 15 + " ghp_" + "a" * 35 + " eyJ" + "x" * 300 + ". key = '" + "b" * 15 + "'\n") * 300
    t0 = time.perf_counter()
    scan(hostile)
    assert time.perf_counter() - t0 < 2.0
