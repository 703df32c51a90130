"""The data plane has one door: no code outside ``onlinerl/dataplane/`` (and tests) sends a Redis command.

Checked on the source of every tracked .py file: a call of a redis-py command method (``r.hset(...)``,
``pipe.xadd(...)``, ``client.eval(...)``, ``execute_command``...), or a raw command list (``("XADD", key, ...)``,
``conn.call("HGETALL", key)``) fails the test with file:line. Also: ``contract.FAMILIES`` and the modules of
``onlinerl/dataplane/`` name each other exactly, so "who writes this key" has one truthful answer.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path

from onlinerl.dataplane.contract import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
DATAPLANE = ROOT / "onlinerl" / "dataplane"
# Modules of the package that are not a key family: the contract itself, its ACLs, the script runner.
NOT_FAMILIES = {"__init__", "contract", "acl", "scripts", "codec"}

# redis-py methods that send a data command; none is a common name of another library's method.
_COMMAND_WORDS = """
    hset hget hgetall hmget hmset hdel hsetnx hincrby hincrbyfloat hkeys hvals hlen hexists hscan hscan_iter hstrlen
    xadd xrange xrevrange xread xreadgroup xack xdel xtrim xautoclaim xclaim xpending xpending_range xgroup_create
    xgroup_createconsumer xgroup_destroy xgroup_delconsumer xgroup_setid xinfo_stream xinfo_groups xinfo_consumers xlen
    zadd zrange zrangebyscore zrevrange zrevrangebyscore zrem zremrangebyscore zremrangebyrank zcard zscore zincrby
    zcount zpopmin zpopmax zmscore sadd srem smembers sismember scard spop lpush rpush lpop rpop lrange llen ltrim lrem
    blpop brpop eval evalsha eval_ro evalsha_ro register_script script_load fcall setnx setex psetex getset getdel
    getex mget mset msetnx incr incrby incrbyfloat decr decrby expire pexpire expireat pexpireat ttl pttl persist
    scan_iter execute_command
"""
COMMAND_METHODS = set(_COMMAND_WORDS.split())
# Generic names (dict.get, set(), Path.exists...): a Redis call only when its receiver is named like a client.
AMBIGUOUS_METHODS = {"get", "set", "delete", "exists", "keys", "type", "scan", "pipeline"}
CLIENT_NAME = re.compile(r"(^|_)(redis|rds|valkey|pipe|pipeline|writes|reads)$", re.I)
NAMES_A_KEY = re.compile(r"\bkeys\.|\bKeys\(|\.prefix\b")
# Raw command lists: a command name as the first element of a tuple/list, or the first argument of a call.
RAW_COMMANDS = {m.upper() for m in COMMAND_METHODS if "_" not in m} | {"XGROUP", "XINFO", "SCRIPT", "DEL"}


def _receiver_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def redis_calls(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, what) of every Redis command the source sends directly."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name == "eval" and not node.args:
                continue  # torch's module.eval()
            if name in COMMAND_METHODS or (
                name in AMBIGUOUS_METHODS
                and (
                    CLIENT_NAME.search(_receiver_name(node.func.value))
                    or any(NAMES_A_KEY.search(ast.unparse(a)) for a in node.args)
                )
            ):
                found.append((node.lineno, f".{name}(...)"))
        first: ast.expr | None = None
        if isinstance(node, ast.Tuple | ast.List) and node.elts:
            first = node.elts[0]
        elif isinstance(node, ast.Call) and node.args:
            first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value in RAW_COMMANDS:
            found.append((node.lineno, f'raw command "{first.value}"'))
    return found


def tracked_sources() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True)
    paths = [ROOT / line for line in out.stdout.decode().splitlines()]
    return [
        p for p in paths if p.is_file() and not p.is_relative_to(DATAPLANE) and not p.is_relative_to(ROOT / "tests")
    ]


def test_the_scanner_sees_each_way_of_sending_a_command() -> None:
    source = """
r.hset(k, "a", 1)
await self.redis.xadd(k, {"data": x})
client.get(keys.policy)
pipe.execute_command("EVAL", src, 0)
await self._p.call("HGETALL", key)
cmd = ("XADD", key, "*", "data", e)
self.client.get(self.keys.policy)
d.get("x")
path.exists()
model.eval()
self.client.get("/v1/models")
httpx_client.request("GET", url)
"""
    lines = sorted(line for line, _ in redis_calls(source, "<test>"))
    assert lines == [2, 3, 4, 5, 5, 6, 7, 8]


def test_no_redis_command_outside_the_dataplane() -> None:
    offenders = []
    for path in tracked_sources():
        for line, what in redis_calls(path.read_text(), str(path)):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not offenders, (
        "Redis commands outside onlinerl/dataplane/ (add a function to the key family's module instead):\n"
        + "\n".join(offenders)
    )


def test_every_family_names_a_module_and_every_module_is_a_family() -> None:
    named = {f.module for f in FAMILIES}
    present = {p.stem for p in DATAPLANE.glob("*.py")} - NOT_FAMILIES
    assert named - present == set(), f"contract.FAMILIES names modules that do not exist: {sorted(named - present)}"
    assert present - named == set(), f"dataplane modules no family names: {sorted(present - named)}"
    for module in sorted(named):
        importlib.import_module(f"onlinerl.dataplane.{module}")
