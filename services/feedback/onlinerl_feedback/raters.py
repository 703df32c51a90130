"""Whose rollouts a key may rate (``feedback.rateScope``).

Why: a rollout record names the user it was served to (``RolloutRecord.user_hash``, the gateway's hash of the key).
If any key of a tenant could rate any of the tenant's rollouts, whoever knows a prompt could rate someone else's
completion first: its sample would train the policy, its counters would move that user's arm, and the contribution
would count against the wrong user, while the real user's rating would then be refused as a duplicate. So by default
(``user``) an event joins only rollouts served to the key that sends it; ``tenant`` is the documented opt-out for one
key shared by a team, or a client that uploads for everyone.
"""

from __future__ import annotations

from onlinerl.auth import bearer_token, user_hash


def rater_of(authorization: bytes | None, rate_scope: str) -> str | None:
    """The rating key's user hash, as the gateway computed it for the rollouts it served to that key (keyless
    traffic: the hash of the empty key, one shared user, as at the gateway); None under ``rateScope: tenant``."""
    if rate_scope == "tenant":
        return None
    token = bearer_token(authorization.decode("latin-1") if authorization else None)
    return user_hash(token or "")
