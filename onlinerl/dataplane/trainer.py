"""The trainer family (``trainer``, ``trainer:lease``, ``trainer:fence``): one trainer at a time, a lease with a
fencing token checked by Redis itself before every announce and acknowledge, and the trainer's status hash.

Why: when the spec changes the operator replaces the trainer Job while the old pod still runs through its grace
period. Two trainers announcing ``max(...) + 1`` fork the lineage, and a stale one acknowledging drops samples the new
one never trained. So each trainer first takes ``trainer:lease`` (SET NX PX) with a token from INCR ``trainer:fence``
(strictly increasing, never reused), renews it from a thread while it runs, and announces (XADD ``checkpoints``) and
acknowledges (XACK + XDEL ``samples``) only through the Lua scripts below, which refuse unless the lease still holds
the caller's token and name (a token comes again only if ``trainer:fence`` itself is lost; the name tells the two
holders of a repeated token apart). A holder whose lease lapsed (paused, partitioned) is therefore refused by Redis
even if it does not know it yet. The same holder name (the pod name: a restarted container in the same pod) takes the
lease over at once; any other holder waits for it to be released or to expire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from onlinerl.dataplane.codec import str_map, text
from onlinerl.dataplane.scripts import Script
from onlinerl.keys import SAMPLES_GROUP, Keys

log = logging.getLogger("onlinerl.trainer")

# KEYS[1] lease, KEYS[2] fence; ARGV holder, ttl_ms. Returns {token, ""} when taken, {0, "<value>"} when held.
_ACQUIRE = Script("""
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder = string.match(cur, '^%d+ (.*)$')
  if holder ~= ARGV[1] then return {0, cur} end
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1], 'PX', tonumber(ARGV[2]))
return {token, ''}
""")

# The lease is still ours? Shared prefix of every fenced script (KEYS[1] lease, ARGV[1] the lease's whole value,
# "<token> <holder>"). Token and holder both: tokens never repeat while trainer:fence lives, but a flush or a failover
# to a replica that missed the last INCR restarts them at 1, and a stale trainer holding an old 1 must not pass for
# the new holder of a new 1 (renew its lease, announce or acknowledge under it).
_CHECK = """
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return redis.error_reply('FENCED lease lost') end
"""

_RENEW = Script(_CHECK + "return redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))")
_RELEASE = Script(_CHECK + "return redis.call('DEL', KEYS[1])")

# KEYS[1] lease, KEYS[2] checkpoints; ARGV token, version, field, value, ... Versions only ever grow on the stream.
_ANNOUNCE = Script(
    _CHECK
    + """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last > 0 then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'version' and tonumber(f[i + 1]) >= tonumber(ARGV[2]) then
      return redis.error_reply('STALEVERSION v' .. ARGV[2] .. ' is not newer than announced v' .. f[i + 1])
    end
  end
end
return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
"""
)

# KEYS[1] lease, KEYS[2] samples; ARGV token, group, id, id, ...
_ACK = Script(
    _CHECK
    + """
local ids = {unpack(ARGV, 3)}
redis.call('XACK', KEYS[2], ARGV[2], unpack(ids))
return redis.call('XDEL', KEYS[2], unpack(ids))
"""
)

ACK_CHUNK = 1000  # ids per script call: Lua's unpack has a stack limit (~8000)


class FencedOut(RuntimeError):
    """This trainer no longer holds the lease: another one is (or may be) the trainer now. Exit, never publish."""


class Lease:
    """The trainer lease of one job, held by ``holder`` (the pod name) with a fencing ``token``."""

    def __init__(self, client: redis.Redis, keys: Keys, holder: str, ttl_ms: int = 15_000) -> None:
        self.client = client
        self.keys = keys
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.token: int = 0  # 0: not held
        self.lost = threading.Event()  # set by the renewer when the lease was taken or expired
        self._scripts = {"renew": _RENEW, "release": _RELEASE, "announce": _ANNOUNCE, "ack": _ACK}
        self._renewer: threading.Thread | None = None
        self._stop_renew = threading.Event()
        self.last_renewed = 0.0  # monotonic time of the last renewal (or of taking the lease)

    def health(self) -> tuple[bool, str]:
        """The trainer's ``/healthz``: it fails when this trainer can no longer do its job — the lease is lost, or
        Redis has not answered a renewal for two thirds of the TTL — so the orchestrator restarts it. A standby
        waiting for the lease is healthy: waiting is its job."""
        if self.lost.is_set():
            return False, "the trainer lease is lost (taken over, or not renewed for its whole TTL)"
        if not self.token or self._renewer is None:
            return True, "waiting for the trainer lease"
        quiet = time.monotonic() - self.last_renewed
        if quiet > self.ttl_ms / 1000 * 2 / 3:
            return False, f"could not renew the trainer lease for {quiet:.1f} s (is Redis reachable?)"
        return True, f"training: lease held with fencing token {self.token}"

    @property
    def value(self) -> str:
        """The lease's value while we hold it, ``"<token> <holder>"``: what every fenced script compares."""
        return f"{self.token} {self.holder}"

    # --- holding ------------------------------------------------------------------------------------------------
    def try_acquire(self) -> str | None:
        """Take the lease (a fresh token). Returns None when taken, else who holds it (``"<token> <holder>"``)."""
        token, current = _ACQUIRE.run(
            self.client, [self.keys.trainer_lease, self.keys.trainer_fence], [self.holder, self.ttl_ms]
        )
        if int(token) == 0:
            return text(current)
        self.token = int(token)
        self.lost.clear()
        return None

    def acquire(self, stop: threading.Event | None = None, poll_s: float = 1.0) -> bool:
        """Wait until the lease is ours (True) or ``stop`` is set (False). While waiting, the status hash's
        ``waiting_for_lease`` field names us (the holder alone writes ``state``); we clear it once we hold the lease."""
        logged = None
        while True:
            current = self.try_acquire()
            if current is None:
                log.info("holding the trainer lease as %r with fencing token %d", self.holder, self.token)
                self.client.hdel(self.keys.trainer_status, "waiting_for_lease")
                self.start_renewing()
                return True
            if current != logged:
                ttl = self.client.pttl(self.keys.trainer_lease)
                log.warning(
                    "waiting for the trainer lease: held by %r (token %s), expires in %d ms unless renewed; "
                    "only one trainer may publish",
                    current.partition(" ")[2],
                    current.partition(" ")[0],
                    ttl,
                )
                logged = current
            waiting = f"{self.holder} since {time.time():.3f} (lease held by {current.partition(' ')[2]})"
            self.client.hsetnx(self.keys.trainer_status, "waiting_for_lease", waiting)
            if stop is not None and stop.wait(poll_s):
                return False
            if stop is None:
                time.sleep(poll_s)

    def renew(self) -> bool:
        try:
            _RENEW.run(self.client, [self.keys.trainer_lease], [self.value, self.ttl_ms])
            return True
        except redis.ResponseError as exc:
            if "FENCED" not in str(exc):
                raise
            if not self.lost.is_set():
                log.error("lost the trainer lease (token %d): another trainer holds it; not publishing", self.token)
            self.lost.set()
            return False

    def check(self) -> None:
        """Raise ``FencedOut`` unless we still hold the lease (checked before writing a version)."""
        self._fenced("renew", [self.keys.trainer_lease], [self.ttl_ms])

    def start_renewing(self) -> None:
        """Renew every third of the TTL from a thread: a PPO step on CPU can take longer than the TTL."""
        if self._renewer is not None:
            return
        self._stop_renew.clear()

        self.last_renewed = time.monotonic()

        def loop() -> None:
            while not self._stop_renew.wait(self.ttl_ms / 3000):
                try:
                    if not self.renew():
                        return
                    self.last_renewed = time.monotonic()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    if time.monotonic() - self.last_renewed >= self.ttl_ms / 1000:
                        log.error("could not renew the trainer lease for its whole TTL (%s): it is lost", exc)
                        self.lost.set()
                        return
                    log.warning("could not renew the trainer lease (%s): retrying", exc)

        self._renewer = threading.Thread(target=loop, name="trainer-lease", daemon=True)
        self._renewer.start()

    def stop_renewing(self) -> None:
        """Stop the renewal thread and wait for it; the lease then lapses at its TTL unless released. No Redis call."""
        self._stop_renew.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
            self._renewer = None

    def release(self) -> None:
        """Give the lease up (a waiting trainer takes over at once); a no-op when it is no longer ours."""
        self.stop_renewing()
        if self.token:
            try:
                _RELEASE.run(self.client, [self.keys.trainer_lease], [self.value])
            except redis.ResponseError as exc:
                if "FENCED" not in str(exc):
                    raise
        self.token = 0

    # --- fenced writes ------------------------------------------------------------------------------------------
    def _fenced(self, name: str, keys: list[str], args: list) -> object:
        try:
            return self._scripts[name].run(self.client, keys, [self.value, *args])
        except redis.ResponseError as exc:
            if "FENCED" in str(exc):
                self.lost.set()
                raise FencedOut(f"{name} refused: the trainer lease is no longer held with token {self.token}") from exc
            if "STALEVERSION" in str(exc):
                raise FencedOut(f"{name} refused: {exc}") from exc
            raise

    def announce(self, fields: dict[str, str], checkpoints_key: str | None = None) -> None:
        """XADD to ``checkpoints`` if we hold the lease and the version is newer than the last one announced there.
        ``checkpoints_key``: a policy line's own stream (``Keys.for_project(p).checkpoints``, issue 39); one lease
        fences every line of the job."""
        fields = {**fields, "fence": str(self.token)}  # who announced it: tokens only grow along the lineage
        flat = [x for kv in fields.items() for x in kv]
        stream = checkpoints_key or self.keys.checkpoints
        self._fenced("announce", [self.keys.trainer_lease, stream], [fields["version"], *flat])

    def ack(self, sample_ids: Sequence[str]) -> int:
        """XACK + XDEL on ``samples`` if we hold the lease."""
        ids = list(sample_ids)
        for i in range(0, len(ids), ACK_CHUNK):
            self._fenced("ack", [self.keys.trainer_lease, self.keys.samples], [SAMPLES_GROUP, *ids[i : i + ACK_CHUNK]])
        return len(ids)


# --- the status hash (``Keys.trainer_status``): written by the lease holder, read by the operator and `status` ---
def write_status(client: redis.Redis, keys: Keys, fields: dict[str, str]) -> None:
    """Set fields of the trainer's status hash (step, version, state, last_checkpoint_at, corrupt_versions...)."""
    client.hset(keys.trainer_status, mapping=fields)


def read_status(client: redis.Redis, keys: Keys) -> dict[str, str]:
    return str_map(client.hgetall(keys.trainer_status))


async def read_status_async(client: Any, keys: Keys) -> dict[str, str]:
    return str_map(await client.hgetall(keys.trainer_status))
