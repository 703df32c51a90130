"""The samples stream as the trainer consumes it. It lives in the data plane (``onlinerl.dataplane.samples``); this
import path stays for the trainer's modules."""

from onlinerl.dataplane.samples import DEFAULT_CONSUMER, Entry, SampleStream

__all__ = ["DEFAULT_CONSUMER", "Entry", "SampleStream"]
