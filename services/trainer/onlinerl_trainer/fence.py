"""One trainer at a time: the lease with a fencing token. It lives in the data plane (``onlinerl.dataplane.trainer``,
with its Lua scripts); this import path stays for the trainer's modules."""

from onlinerl.dataplane.trainer import ACK_CHUNK, FencedOut, Lease

__all__ = ["ACK_CHUNK", "FencedOut", "Lease"]
