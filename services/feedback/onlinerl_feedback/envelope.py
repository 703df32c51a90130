"""Stock Continue's dev-data upload (``data:`` destinations in ``config.yaml``): parse the envelope, say what it is.

Continue's ``DataLogger`` (core/data/log.ts) POSTs every event it logs as
``{"name": <event>, "data": <fields>, "schema": "0.1.0"|"0.2.0", "level": "all"|"noCode", "profileId": ...}``,
where ``data`` is the event parsed with ``devDataVersionedSchemas[schema][level][name]`` from the published npm
package ``@continuedev/config-yaml`` (unknown keys dropped). Only ``autocomplete`` at level ``all`` is an
AutocompleteOutcome we can join and train on; everything else must still be answered 2xx, because Continue logs every
non-ok reply in the user's editor and a Continue upgrade (a new schema version, a new event) must never break it.

Pure: no I/O. The HTTP layer (app.py) turns a :class:`Kind` into the reply and the audit entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import orjson

# The schema versions whose autocomplete event we know to be an AutocompleteOutcome (devDataVersionedSchemas' keys).
KNOWN_SCHEMAS = ("0.1.0", "0.2.0")
# Event names Continue logs (devEventAllVersionDataSchemas); any other name is counted as "other" (bounded labels).
EVENT_NAMES = (
    "autocomplete",
    "quickEdit",
    "chatFeedback",
    "tokensGenerated",
    "chatInteraction",
    "editInteraction",
    "editOutcome",
    "nextEditOutcome",
    "nextEditWithHistory",
    "toolUsage",
)
AUTOCOMPLETE = "autocomplete"
# The fields level ``noCode`` drops from an autocomplete event; without the prompt and the shown text nothing joins.
CODE_FIELDS = ("prompt", "completion")

# Reasons of an audited (never trained) envelope.
NO_CODE = "no_code"
UNKNOWN_SCHEMA = "unknown_schema"


class Kind(Enum):
    OUTCOME = "outcome"  # autocomplete, known schema, level all: joined and trained as the direct upload
    NO_CODE = NO_CODE  # autocomplete without its code (level noCode): audited
    UNKNOWN_SCHEMA = UNKNOWN_SCHEMA  # a schema version we do not know: audited, counted, warned about once
    IGNORED = "ignored"  # another event (tokensGenerated, chatFeedback, ...): counted by name only


class EnvelopeError(ValueError):
    """The body is not Continue's envelope: ``reason`` and ``param`` for the 422 reply, a message that says what
    to fix."""

    def __init__(self, reason: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.param = reason, message, param


@dataclass(frozen=True)
class Envelope:
    name: str
    data: dict
    schema: str
    level: str

    @property
    def kind(self) -> Kind:
        if self.schema not in KNOWN_SCHEMAS:
            return Kind.UNKNOWN_SCHEMA
        if self.name != AUTOCOMPLETE:
            return Kind.IGNORED
        if self.level != "all" or any(not isinstance(self.data.get(f), str) for f in CODE_FIELDS):
            return Kind.NO_CODE
        return Kind.OUTCOME

    @property
    def name_label(self) -> str:
        """The event name as a metric label: one of Continue's names, else ``other`` (a client picks the name)."""
        return self.name if self.name in EVENT_NAMES else "other"

    @property
    def schema_label(self) -> str:
        return self.schema if self.schema in KNOWN_SCHEMAS else "unknown"

    @property
    def completion_id(self) -> str:
        cid = self.data.get("completionId")
        return cid[:256] if isinstance(cid, str) else ""

    @property
    def accepted(self) -> bool | None:
        value = self.data.get("accepted")
        return value if isinstance(value, bool) else None


def parse_envelope(body: bytes) -> Envelope:
    """The envelope in ``body``, or :class:`EnvelopeError` naming what is missing (``name``, ``data``)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise EnvelopeError("invalid_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise EnvelopeError(
            "invalid_body", 'body must be a JSON object: Continue\'s {"name": ..., "data": {...}, "schema": ...}'
        )
    name, data = doc.get("name"), doc.get("data")
    if not isinstance(name, str) or not name:
        raise EnvelopeError("invalid_field", "field 'name' (the event name, e.g. autocomplete) is required", "name")
    if not isinstance(data, dict):
        raise EnvelopeError("invalid_field", "field 'data' (the event's fields, a JSON object) is required", "data")
    schema, level = doc.get("schema"), doc.get("level", "all")
    return Envelope(name, data, schema if isinstance(schema, str) else "", level if isinstance(level, str) else "")


__all__ = ["AUTOCOMPLETE", "KNOWN_SCHEMAS", "NO_CODE", "UNKNOWN_SCHEMA", "Envelope", "EnvelopeError", "Kind"]
