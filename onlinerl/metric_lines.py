"""The ``line`` label of the metrics that are per policy line (issue 39): which value a line's series carry, bounded.

Values: ``shared`` for the shared policy's line (``Keys.line == ""``; an empty label value would read as "no label"
in PromQL), the project's name for a project's own line, and ``other`` for the project lines beyond the cap. A
project whose name is itself ``shared`` or ``other`` (both are legal tenant names) is labelled ``@shared`` /
``@other`` (``@``, as in its adapter name ``{job}@{project}-v{N}``, is in no tenant name), so no project's series
ever merge with the shared line's or with the overflow.

Why a cap: a line exists only for a project with an adapter of its own (``ProjectsConfig.has_own_line``), and every
project is the tenant of keys in the keys file, so the values are already bounded by the keys file, as the ``tenant``
labels are. But under ``projects.adapters: all`` that can be every tenant (1,000 and more), and each line multiplies
the series of every labelled family (versions x arms x lines). So one process names at most ``cap`` project lines
(:data:`MAX_NAMED_LINES` by default): the first ones it counts something for, which are the ones with traffic. They
keep their label for the life of the process (a counter's series must not change name mid-way); every later line
counts under ``other``. A gauge of a figure that has no meaning summed over lines (a version, a canary share) is not
exported for ``other`` lines: ``named`` says whether a line has its own label. With ``feedback.workers`` > 1 each
worker names its own first lines, so a pod exports at most workers x cap project values.
"""

from __future__ import annotations

import threading

from onlinerl.keys import SHARED_LINE

SHARED_LABEL = "shared"
OTHER_LABEL = "other"
MAX_NAMED_LINES = 50
_RESERVED = (SHARED_LABEL, OTHER_LABEL)


def project_label(project: str) -> str:
    """The ``line`` value of ``project``'s own line (uncapped; ``LineLabels`` decides whether it gets one)."""
    return f"@{project}" if project in _RESERVED else project


class LineLabels:
    """Line -> ``line`` label value, naming at most ``cap`` project lines per process (see the module doc)."""

    def __init__(self, cap: int = MAX_NAMED_LINES) -> None:
        if cap < 0:
            raise ValueError(f"cap {cap} < 0: the number of project lines labelled by name cannot be negative")
        self.cap = cap
        self._named: set[str] = set()
        self._lock = threading.Lock()  # the trainer counts from more than one thread

    def __call__(self, line: str) -> str:
        """The label of ``line`` ('' is the shared line), naming it now if the cap leaves room."""
        if line == SHARED_LINE:
            return SHARED_LABEL
        if line not in self._named:
            with self._lock:
                if len(self._named) >= self.cap:
                    return OTHER_LABEL
                self._named.add(line)
        return project_label(line)

    def named(self, line: str) -> bool:
        """Whether ``line`` has (or now gets) a label of its own: False for a line counted under ``other``."""
        return self(line) != OTHER_LABEL

    def known(self, line: str) -> str | None:
        """``line``'s label if it already has one of its own, else None; never names a line (for dropping a line's
        series: an idle line must not take a place under the cap)."""
        if line == SHARED_LINE:
            return SHARED_LABEL
        return project_label(line) if line in self._named else None
