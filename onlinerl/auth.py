"""Bearer API keys -> (tenant, role), shared by serving and feedback.

The keys file (a mounted Secret) is YAML: ``{tenants: {acme: {keys: [sk-..., {key: sk-..., role: eval}]}}}``. A plain
string is a ``user`` key (the old format stays valid). Roles: ``user`` may complete and send feedback; ``eval`` may
also pin a policy version (``X-OnlineRL-Version``: evaluation, the rollout gate); ``admin`` may do everything. Keys
are held only as sha256 digests and compared with ``hmac.compare_digest`` against every digest, so timing reveals
neither key nor position.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from onlinerl.keys import tenant_problem
from onlinerl.secretfile import write_secret

ANONYMOUS_TENANT = "anonymous"
ROLES = ("user", "eval", "admin")
PIN_ROLES = frozenset({"eval", "admin"})  # may ask for a policy version explicitly


class AuthConfigError(ValueError):
    """The keys file is missing or malformed."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def user_hash(api_key: str) -> str:
    """Stable, non-reversible id of the user behind an authenticated key (the key itself never leaves the service).
    The gateway routes by it and stores it in each rollout record (``RolloutRecord.user_hash``); feedback computes it
    for the rater, so a key rates only the rollouts served to it (``feedback.rateScope``)."""
    return hashlib.sha256(f"{api_key}\0".encode()).hexdigest()[:32]


def bearer_token(authorization: str | None) -> str | None:
    """The token from ``Authorization: Bearer <token>`` (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass(frozen=True)
class Identity:
    """Who a request authenticated as. ``key_id`` is a non-reversible id of the key (the key never leaves here)."""

    tenant: str
    role: str = "user"
    key_id: str = ""

    @property
    def may_pin(self) -> bool:
        return self.role in PIN_ROLES


ANONYMOUS = Identity(ANONYMOUS_TENANT, "user", "")


def reveals_routing(identity: Identity, routing_headers: str) -> bool:
    """Whether ``identity`` may learn which arm and policy version served it (``serving.routingHeaders``): eval and
    admin keys always (evaluation and tools need it); a user key only under ``all`` (test and debugging stacks). A
    user who knows it is in the canary could steer that arm's statistics (issue 35)."""
    return identity.may_pin or routing_headers == "all"


def _entry(tenant: str, i: int, item: object) -> tuple[str, str]:
    """``(key, role)`` of one keys-file entry: a plain string (role user) or ``{key: ..., role: ...}``."""
    if isinstance(item, str) and item:
        return item, "user"
    where = f"tenants.{tenant}.keys[{i}]"
    if not isinstance(item, dict) or not isinstance(item.get("key"), str) or not item["key"]:
        raise AuthConfigError(f"{where} must be a key string or {{key: <key>, role: user|eval|admin}}")
    unknown = set(item) - {"key", "role"}
    if unknown:
        raise AuthConfigError(f"{where} has unknown field(s) {sorted(unknown)}; allowed: key, role")
    role = item.get("role", "user")
    if role not in ROLES:
        raise AuthConfigError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
    return item["key"], role


@dataclass
class KeyRing:
    """Identity lookup by API key in constant time per key."""

    entries: list[tuple[bytes, Identity]] = field(default_factory=list)
    allow_anonymous: bool = False

    @classmethod
    def from_mapping(cls, data: dict, allow_anonymous: bool = False) -> KeyRing:
        tenants = (data or {}).get("tenants")
        if not isinstance(tenants, dict):
            raise AuthConfigError("keys file must hold `tenants: {<tenant>: {keys: [<key>, ...]}}`")
        entries = []
        seen: set[bytes] = set()
        for tenant, spec in tenants.items():
            problem = tenant_problem(tenant)
            if problem is not None:
                raise AuthConfigError(f"keys file tenants.{tenant}: {problem}")
            keys = (spec or {}).get("keys") if isinstance(spec, dict) else None
            if not isinstance(keys, list) or not keys:
                raise AuthConfigError(f"tenants.{tenant}.keys must be a non-empty list")
            for i, item in enumerate(keys):
                key, role = _entry(str(tenant), i, item)
                digest = _digest(key)
                if digest in seen:
                    raise AuthConfigError(f"tenants.{tenant}.keys[{i}] is listed twice: every key has one owner")
                seen.add(digest)
                entries.append((digest, Identity(str(tenant), role, digest.hex()[:32])))
        return cls(entries, allow_anonymous)

    @classmethod
    def from_file(cls, path: str | Path, allow_anonymous: bool = False) -> KeyRing:
        p = Path(path)
        if not p.is_file():
            raise AuthConfigError(f"auth.apiKeysFile {p} does not exist")
        try:
            return cls.from_mapping(yaml.safe_load(p.read_text()), allow_anonymous)
        except yaml.YAMLError as exc:
            raise AuthConfigError(f"auth.apiKeysFile {p} is not valid YAML: {exc}") from exc

    def identity_for(self, token: str | None) -> Identity | None:
        """Who owns ``token``; None for unknown or missing keys (the anonymous user identity if allowed)."""
        if token is None:
            return ANONYMOUS if self.allow_anonymous else None
        probe = _digest(token)
        found = None
        for digest, identity in self.entries:  # no early exit: constant work whatever the key
            if hmac.compare_digest(digest, probe):
                found = identity
        if found is None and self.allow_anonymous:
            return ANONYMOUS
        return found

    def tenant_for(self, token: str | None) -> str | None:
        """The tenant owning ``token``; None for unknown or missing keys (anonymous tenant if allowed)."""
        identity = self.identity_for(token)
        return identity.tenant if identity else None


def new_api_key(prefix: str = "orl") -> str:
    return f"{prefix}-{secrets.token_urlsafe(24)}"


def write_keys_file(path: Path, tenants: dict[str, list[str | dict[str, str]]]) -> Path:
    """Entries are key strings (role user) or ``{"key": ..., "role": "eval"}``."""
    return write_secret(path, yaml.safe_dump({"tenants": {t: {"keys": ks} for t, ks in tenants.items()}}))


def key_with_role(
    path: str | Path,
    roles: tuple[str, ...] = ("eval", "admin"),
    tenant_ok: Callable[[str], bool] | None = None,
    wanted: str = "a tenant",
) -> tuple[str, str]:
    """``(key, tenant)`` of the first key in the keys file whose role is in ``roles`` (the rollout gate and
    `onlinerl eval` pin versions, which a ``user`` key may not). ``tenant_ok``: only keys of tenants it accepts (a
    project's own policy line is reached through that project's keys: issue 39), named ``wanted`` in the error."""
    tenants = (yaml.safe_load(Path(path).read_text()) or {}).get("tenants") or {}
    for tenant, spec in tenants.items():
        if tenant_ok is not None and not tenant_ok(str(tenant)):
            continue
        for i, item in enumerate((spec or {}).get("keys") or []):
            key, role = _entry(str(tenant), i, item)
            if role in roles:
                return key, str(tenant)
    raise AuthConfigError(
        f"{path} has no key with role {' or '.join(roles)} of {wanted}: add one as `{{key: <key>, role: eval}}` "
        f"under {wanted}"
    )
