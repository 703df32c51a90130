"""Bearer API keys -> tenant, shared by serving and feedback.

The keys file (a mounted Secret) is YAML: ``{tenants: {acme: {keys: [sk-...]}}}``. Keys are held only as sha256
digests and compared with ``hmac.compare_digest`` against every digest, so timing reveals neither key nor position.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ANONYMOUS_TENANT = "anonymous"


class AuthConfigError(ValueError):
    """The keys file is missing or malformed."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The token from ``Authorization: Bearer <token>`` (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass
class KeyRing:
    """Tenant lookup by API key in constant time per key."""

    entries: list[tuple[bytes, str]] = field(default_factory=list)
    allow_anonymous: bool = False

    @classmethod
    def from_mapping(cls, data: dict, allow_anonymous: bool = False) -> KeyRing:
        tenants = (data or {}).get("tenants")
        if not isinstance(tenants, dict):
            raise AuthConfigError("keys file must hold `tenants: {<tenant>: {keys: [<key>, ...]}}`")
        entries = []
        for tenant, spec in tenants.items():
            keys = (spec or {}).get("keys") if isinstance(spec, dict) else None
            if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
                raise AuthConfigError(f"tenants.{tenant}.keys must be a non-empty list of strings")
            entries += [(_digest(k), str(tenant)) for k in keys]
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

    def tenant_for(self, token: str | None) -> str | None:
        """The tenant owning ``token``; None for unknown or missing keys (anonymous tenant if allowed)."""
        if token is None:
            return ANONYMOUS_TENANT if self.allow_anonymous else None
        probe = _digest(token)
        found = None
        for digest, tenant in self.entries:  # no early exit: constant work whatever the key
            if hmac.compare_digest(digest, probe):
                found = tenant
        if found is None and self.allow_anonymous:
            return ANONYMOUS_TENANT
        return found


def new_api_key(prefix: str = "orl") -> str:
    return f"{prefix}-{secrets.token_urlsafe(24)}"


def write_keys_file(path: Path, tenants: dict[str, list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"tenants": {t: {"keys": ks} for t, ks in tenants.items()}}))
    path.chmod(0o600)
    return path
