"""Fake credentials of every format the secret screening knows, seeded (deterministic), and a dump of everything a
Redis server holds: what the privacy tests and bench/secret_screening.py plant and look for.

Every value is random, made here, and matches the provider's published shape only: none is a real credential.
"""

from __future__ import annotations

import base64
import json
import random
import string
from collections.abc import Callable, Iterator

import redis

UPPER_DIGITS = string.ascii_uppercase + string.digits
ALNUM = string.ascii_letters + string.digits
B64 = ALNUM + "+/"
URLSAFE = ALNUM + "-_"


def _pick(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def fake_aws_key_id(seed: int) -> str:
    return "AKIA" + _pick(random.Random(seed), UPPER_DIGITS, 16)


def fake_github_token(seed: int) -> str:
    return "ghp_" + _pick(random.Random(seed), ALNUM, 36)


def _jwt(rng: random.Random) -> str:
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'HS256', 'typ': 'JWT'})}.{part({'sub': _pick(rng, ALNUM, 10)})}.{_pick(rng, URLSAFE, 43)}"


def _private_key(rng: random.Random) -> str:
    body = "\n".join(_pick(rng, B64, 64) for _ in range(4))
    return f"-----BEGIN RSA PRIVATE KEY-----\n{body}\n-----END RSA PRIVATE KEY-----"


# kind -> (make the secret from an rng, how code typically holds it: a format string with {s})
FORMATS: dict[str, tuple[Callable[[random.Random], str], str]] = {
    "aws_access_key_id": (lambda r: "AKIA" + _pick(r, UPPER_DIGITS, 16), 'AWS_ACCESS_KEY_ID = "{s}"'),
    "aws_secret_access_key": (lambda r: _pick(r, B64, 40), 'aws_secret_access_key = "{s}"'),
    "gcp_api_key": (lambda r: "AIza" + _pick(r, URLSAFE, 35), 'GOOGLE_MAPS_KEY = "{s}"'),
    "azure_storage_key": (
        lambda r: _pick(r, B64, 86) + "==",
        'conn = "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={s};EndpointSuffix=core.windows.net"',
    ),
    "github_token": (lambda r: "ghp_" + _pick(r, ALNUM, 36), 'headers = {{"Authorization": "token {s}"}}'),
    "gitlab_token": (lambda r: "glpat-" + _pick(r, URLSAFE, 20), 'gitlab = Gitlab(url, private_token="{s}")'),
    "slack_token": (
        lambda r: f"xoxb-{_pick(r, string.digits, 11)}-{_pick(r, string.digits, 12)}-{_pick(r, ALNUM, 24)}",
        'client = WebClient(token="{s}")',
    ),
    "slack_webhook": (
        lambda r: (
            f"https://hooks.slack.com/services/T{_pick(r, UPPER_DIGITS, 8)}/B{_pick(r, UPPER_DIGITS, 8)}/"
            f"{_pick(r, ALNUM, 24)}"
        ),
        'WEBHOOK = "{s}"',
    ),
    "stripe_key": (lambda r: "sk_live_" + _pick(r, ALNUM, 24), 'stripe.api_key = "{s}"'),
    "openai_key": (
        lambda r: f"sk-proj-{_pick(r, URLSAFE, 20)}T3BlbkFJ{_pick(r, URLSAFE, 20)}",
        'client = OpenAI(api_key="{s}")',
    ),
    "huggingface_token": (lambda r: "hf_" + _pick(r, string.ascii_letters, 34), 'login(token="{s}")'),
    "npm_token": (lambda r: "npm_" + _pick(r, ALNUM, 36), '"//registry.npmjs.org/:_authToken={s}"'),
    "private_key": (_private_key, 'KEY = """{s}"""'),
    "jwt": (_jwt, 'session = {{"Authorization": "Bearer {s}"}}'),
    "connection_string_password": (
        lambda r: _pick(r, ALNUM, 14),
        'DATABASE_URL = "postgresql://app_user:{s}@db.internal:5432/app"',
    ),
    "high_entropy_assignment": (lambda r: _pick(r, ALNUM, 32), 'SERVICE_TOKEN = "{s}"'),
}


def seeded_secrets(seed: int, per_kind: int) -> list[tuple[str, str, str]]:
    """``per_kind`` (kind, secret, line of code holding it) of every format, deterministic for ``seed``."""
    rng = random.Random(seed)
    out = []
    for kind, (make, line) in FORMATS.items():
        for _ in range(per_kind):
            secret = make(rng)
            out.append((kind, secret, line.format(s=secret)))
    return out


def every_value(client: redis.Redis) -> Iterator[bytes]:
    """Every key name and every stored value of every type on the server (all databases the client sees)."""
    for key in client.scan_iter(count=1000):
        yield key
        kind = client.type(key)
        if kind == b"string":
            yield client.get(key) or b""
        elif kind == b"hash":
            for f, v in client.hgetall(key).items():
                yield f
                yield v
        elif kind == b"list":
            yield from client.lrange(key, 0, -1)
        elif kind == b"set":
            yield from client.smembers(key)
        elif kind == b"zset":
            yield from (m for m, _ in client.zrange(key, 0, -1, withscores=True))
        elif kind == b"stream":
            for _id, fields in client.xrange(key):
                for f, v in fields.items():
                    yield f
                    yield v
