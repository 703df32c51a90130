"""Secret screening: find credentials in text before anything is stored or trained (issue 38).

An online learner trains on its users' code and serves what it learned to everyone: a key that sits in one user's
prompt and is repeated by an accepted completion could be suggested to another user. So the gateway screens every
prompt and completion (``privacy.secretScreening``), and a rollout with a finding is recorded without its text and
token ids (only each finding's kind and position); feedback screens each uploaded event too and audits it
``secret_detected``, never trained.

Rules are compiled regular expressions, one per well-known credential format (cloud keys, GitHub, GitLab, Slack,
private-key blocks, JWTs, connection strings with a password...) plus one high-entropy rule: a long random-looking
string assigned to a name like ``key``, ``token``, ``secret`` or ``password``. Why not ``detect-secrets``: its plugins
scan line by line through its own settings and filter pipeline; bench/secret_screening.py measures both on the same
corpus (bench/RESULTS.md) and these rules find as much at a fraction of the cost per request.

Pure functions, no I/O. A finding carries its kind and character span, never the matched text: what is logged,
counted or stored about a finding cannot leak the secret.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Mode = Literal["off", "audit", "block"]
MODES: tuple[Mode, ...] = ("off", "audit", "block")


@dataclass(frozen=True)
class Finding:
    """One credential-looking span: its rule (``kind``) and character span ``[start, end)`` in the text scanned."""

    kind: str
    start: int
    end: int


# (kind, literal hints, pattern, group holding the secret itself: 0 = the whole match). A rule's regex runs only when
# one of its hints occurs in the text (a substring test: microseconds), so a prompt pays for the rules it could match.
# Hints of ``ci`` rules are tested against the lower-cased text.
_RULES: tuple[tuple[str, tuple[str, ...], str, int], ...] = (
    (
        "aws_access_key_id",
        ("AKIA", "ASIA", "ABIA", "ACCA", "A3T"),
        r"\b(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}\b",
        0,
    ),
    (
        "aws_secret_access_key",
        ("ci:aws",),
        r"(?i)aws.{0,20}?(?:secret|sk).{0,20}?['\"=:\s]\s*['\"]?([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])",
        1,
    ),
    ("gcp_api_key", ("AIza",), r"\bAIza[0-9A-Za-z_\-]{35}(?![0-9A-Za-z_\-])", 0),
    ("azure_storage_key", ("ci:accountkey=",), r"(?i)AccountKey=([A-Za-z0-9+/]{86}==)", 1),
    (
        "github_token",
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
        r"\b(?:gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{82})(?![A-Za-z0-9_])",
        0,
    ),
    (
        "gitlab_token",
        ("glpat-", "gldt-", "glrt-", "glptt-", "glcbt-"),
        r"\bgl(?:pat|dt|rt|ptt|cbt)-[A-Za-z0-9_\-]{20,}(?![A-Za-z0-9_\-])",
        0,
    ),
    ("slack_token", ("xox",), r"\bxox[abposr]-(?:[0-9]+-)+[A-Za-z0-9]{8,}", 0),
    (
        "slack_webhook",
        ("hooks.slack.com",),
        r"https://hooks\.slack\.com/(?:services|workflows)/T[A-Z0-9]{6,}/B[A-Z0-9]{6,}/[A-Za-z0-9]{16,}",
        0,
    ),
    ("stripe_key", ("_live_",), r"\b(?:sk|rk)_live_[0-9A-Za-z]{20,}", 0),
    ("openai_key", ("T3BlbkFJ",), r"\bsk-(?:proj-|svcacct-)?[A-Za-z0-9_\-]{16,}T3BlbkFJ[A-Za-z0-9_\-]{16,}", 0),
    ("anthropic_key", ("sk-ant-",), r"\bsk-ant-(?:api|admin)[0-9]{2}-[A-Za-z0-9_\-]{80,}", 0),
    ("huggingface_token", ("hf_",), r"\bhf_[A-Za-z]{34}\b", 0),
    ("npm_token", ("npm_",), r"\bnpm_[A-Za-z0-9]{36}\b", 0),
    ("twilio_key", ("SK",), r"\bSK[0-9a-f]{32}\b", 0),
    ("sendgrid_key", ("SG.",), r"\bSG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}\b", 0),
    (
        "private_key",
        ("PRIVATE KEY",),
        r"-----BEGIN (?:RSA |EC |DSA |OPENSSH |ENCRYPTED |PGP )?PRIVATE KEY(?: BLOCK)?-----"
        r"(?:[\s\S]*?-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----|[\s\S]*)",
        0,
    ),
    ("jwt", ("eyJ",), r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{16,}", 0),
    # scheme://user:password@host: the password group, unless it is a placeholder (below)
    (
        "connection_string_password",
        ("://",),
        r"\b[a-zA-Z][a-zA-Z0-9+.\-]{1,20}://[^\s:/@'\"`<>]{1,64}:([^\s:/@'\"`<>]{3,128})@[A-Za-z0-9.\-_\[]",
        1,
    ),
)

_COMPILED = tuple((kind, hints, re.compile(pattern), group) for kind, hints, pattern, group in _RULES)

# Password placeholders in documentation and examples: not a secret, never a finding.
_PLACEHOLDERS = re.compile(
    r"(?i)^(?:x+|\*+|\.+|-+|_+|pass(?:word|wd)?\d*|pwd|secret|changeme|example|your[_\-]?\w*|my[_\-]?\w*|"
    r"user(?:name)?|admin|test\w*|dummy|foo|bar|baz|none|null|redacted|p@ssw0rd|\$\{?\w+\}?|%[sd(]\S*|\{\w*\}|<[^>]*>)$"
)

# Keyword + high entropy: NAME = "value" / NAME: value / "name": "value" where NAME mentions a credential. Found from
# the quoted value (one pass over the text for an assignment of a long quoted string), then the name before it is read
# back: a regex that starts at the name would retry at every character of every identifier (milliseconds per prompt).
_QUOTED_ASSIGN = re.compile(r"(?::=|=>|=|:)[ \t]*(?:[A-Za-z_.]{1,32}\()?[ \t]*[bru]?(['\"`])([^'\"`\s]{16,256})\1")
_NAME_BEFORE = re.compile(r"([A-Za-z0-9_.\-]{1,64})['\"]?[ \t]*$")
_CREDENTIAL_NAME = re.compile(r"(?i)key|token|secret|passw(?:or)?d|pwd|credential|auth")
_ENTROPY_CHARS = re.compile(r"^[A-Za-z0-9+/=_\-.~!@#$%^&*]+$")
_MIN_ENTROPY_BITS = 3.5  # bits per character; base64 / hex / random alphanumerics score 3.7-5.9, words under 3.3
_IDENTIFIER_LIKE = re.compile(r"^(?:[a-z]+(?:[_\-.][a-z]+)+|[A-Z]+(?:_[A-Z]+)+|[a-z]+(?:[A-Z][a-z]+)+)$")


def shannon_entropy(value: str) -> float:
    """Bits per character of ``value``'s character distribution."""
    n = len(value)
    if not n:
        return 0.0
    return -sum(c / n * math.log2(c / n) for c in Counter(value).values())


def _random_looking(value: str) -> bool:
    """A credential-like value: one run of key characters, high entropy, digits and letters, not a word chain or
    a path or a format string."""
    if not _ENTROPY_CHARS.match(value) or _IDENTIFIER_LIKE.match(value):
        return False
    if value.count(".") > 2 or "/" in value[:1] or "%" in value or "{" in value:
        return False
    has_digit = any(c.isdigit() for c in value)
    has_alpha = any(c.isalpha() for c in value)
    return has_digit and has_alpha and shannon_entropy(value) >= _MIN_ENTROPY_BITS


def scan(text: str) -> list[Finding]:
    """Every finding in ``text``, ordered by position; a keyword-rule finding is dropped where a format rule already
    covers the span."""
    if not text:
        return []
    lower: str | None = None
    found: list[Finding] = []
    for kind, hints, pattern, group in _COMPILED:
        if hints[0].startswith("ci:"):
            lower = text.lower() if lower is None else lower
            if not any(h[3:] in lower for h in hints):
                continue
        elif not any(h in text for h in hints):
            continue
        for m in pattern.finditer(text):
            if kind == "connection_string_password" and _PLACEHOLDERS.match(m.group(1)):
                continue
            found.append(Finding(kind, m.start(group), m.end(group)))
    for m in _QUOTED_ASSIGN.finditer(text):
        value = m.group(2)
        if not _random_looking(value):
            continue
        name = _NAME_BEFORE.search(text, max(0, m.start() - 70), m.start())
        if name is None or not _CREDENTIAL_NAME.search(name.group(1)):
            continue
        start, end = m.start(2), m.end(2)
        if not any(f.start < end and start < f.end for f in found):
            found.append(Finding("high_entropy_assignment", start, end))
    found.sort(key=lambda f: (f.start, f.end))
    return found


def kinds() -> tuple[str, ...]:
    """Every finding kind a rule can produce (metrics labels are bounded by this)."""
    return (*(rule[0] for rule in _RULES), "high_entropy_assignment")


@dataclass(frozen=True)
class FieldFinding:
    """A finding located in a named field of a record (``prompt`` or ``completion``): what a redacted rollout keeps."""

    field: str
    kind: str
    start: int
    end: int


def scan_fields(fields: Iterable[tuple[str, str]]) -> list[FieldFinding]:
    """``scan`` over several named texts (``[("prompt", ...), ("completion", ...)]``)."""
    return [FieldFinding(name, f.kind, f.start, f.end) for name, value in fields for f in scan(value)]


def describe(findings: Iterable[FieldFinding]) -> str:
    """A message naming each finding by kind and position, never its text (safe for replies and logs)."""
    return ", ".join(f"{f.kind} in the {f.field} at characters {f.start}-{f.end}" for f in findings)
