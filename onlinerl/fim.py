"""Fill-in-the-middle prompt templates: render, parse back, and detect from a tokenizer.

Continue renders the FIM prompt on the client and sends it raw, so the server side needs the inverse too: from the
rendered prompt, recover prefix and suffix (feedback joins and audits on them; simulate/eval render like Continue).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class FimParseError(ValueError):
    """The prompt was not rendered by this template."""


@dataclass(frozen=True)
class Snippet:
    """A context file that Continue's repo-level Qwen prompt carries before the current file."""

    path: str
    content: str


@dataclass(frozen=True)
class FimTemplate:
    """One FIM family: ``begin + prefix + hole + suffix + end`` (or suffix-first when ``suffix_first``)."""

    name: str
    begin: str
    hole: str
    end: str
    stop: tuple[str, ...]
    detect_tokens: tuple[str, ...] = ()
    suffix_first: bool = False
    prefix_only: bool = False
    aliases: tuple[str, ...] = field(default=())

    def render(
        self,
        prefix: str,
        suffix: str = "",
        *,
        repo_name: str = "",
        filepath: str = "",
        snippets: Sequence[Snippet] = (),
    ) -> str:
        """The exact prompt string a client sends for this cursor position."""
        if self.prefix_only:
            return prefix
        if self.suffix_first:
            return f"{self.begin}{suffix}{self.hole}{prefix}"
        head = ""
        if self.name == "qwen" and (snippets or repo_name):
            head = f"<|repo_name|>{repo_name}\n"
            for s in snippets:
                head += f"<|file_sep|>{s.path}\n{s.content}\n"
            head += f"<|file_sep|>{filepath}\n"
        return f"{head}{self.begin}{prefix}{self.hole}{suffix}{self.end}"

    def parse(self, prompt: str) -> tuple[str, str]:
        """Recover ``(prefix, suffix)`` from a prompt rendered by this template (raises :class:`FimParseError`)."""
        if self.prefix_only:
            return prompt, ""
        if self.suffix_first:
            if not prompt.startswith(self.begin):
                raise FimParseError(f"prompt does not start with {self.begin!r}")
            suffix, sep, prefix = prompt[len(self.begin) :].partition(self.hole)
            if not sep:
                raise FimParseError(f"prompt lacks {self.hole!r}")
            return prefix, suffix
        if not prompt.endswith(self.end):
            raise FimParseError(f"prompt does not end with {self.end!r}")
        start = prompt.rfind(self.begin)
        if start < 0:
            raise FimParseError(f"prompt lacks {self.begin!r}")
        body = prompt[start + len(self.begin) : len(prompt) - len(self.end)]
        hole = body.rfind(self.hole)
        if hole < 0:
            raise FimParseError(f"prompt lacks {self.hole!r}")
        return body[:hole], body[hole + len(self.hole) :]

    def matches(self, prompt: str) -> bool:
        try:
            self.parse(prompt)
        except FimParseError:
            return False
        return True


_QWEN_STOP = (
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<|im_start|>",
    "<|im_end|>",
    "/src/",
    "#- coding: utf-8",
    "```",
)

TEMPLATES: dict[str, FimTemplate] = {
    t.name: t
    for t in (
        FimTemplate(
            "qwen",
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            _QWEN_STOP,
            detect_tokens=("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
            aliases=("qwen2.5-coder",),
        ),
        FimTemplate(
            "starcoder",
            "<fim_prefix>",
            "<fim_suffix>",
            "<fim_middle>",
            ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<|endoftext|>"),
            detect_tokens=("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
            aliases=("stable-code",),
        ),
        FimTemplate(
            "santacoder",
            "<fim-prefix>",
            "<fim-suffix>",
            "<fim-middle>",
            ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", "<|endoftext|>"),
            detect_tokens=("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
        ),
        FimTemplate(
            "codellama",
            "<PRE> ",
            " <SUF>",
            " <MID>",
            ("<PRE>", "<SUF>", "<MID>", "<EOT>"),
            detect_tokens=("▁<PRE>", "▁<SUF>", "▁<MID>"),
        ),
        FimTemplate(
            "deepseek",
            "<｜fim▁begin｜>",
            "<｜fim▁hole｜>",
            "<｜fim▁end｜>",
            ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<｜end▁of▁sentence｜>"),
            detect_tokens=("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
            aliases=("deepseek-coder",),
        ),
        # Models without FIM tokens: suffix first as context, then the prefix, so generation simply continues it.
        FimTemplate("plain", "<SUFFIX>\n", "\n</SUFFIX>\n", "", ("</SUFFIX>", "<SUFFIX>"), suffix_first=True),
        FimTemplate("prefix-only", "", "", "", (), prefix_only=True),
    )
}

FALLBACK_TEMPLATE = "plain"


def get_template(name: str) -> FimTemplate:
    """A template by name or alias; unknown names fail with the list of known ones."""
    key = name.strip().lower()
    if key in TEMPLATES:
        return TEMPLATES[key]
    for t in TEMPLATES.values():
        if key in t.aliases:
            return t
    raise KeyError(f"unknown FIM template {name!r}; known: {', '.join(sorted(TEMPLATES))}")


def detect_template(vocab: Iterable[str]) -> FimTemplate:
    """Pick the template whose special tokens the tokenizer has (``tokenizer.get_vocab()`` keys); else the fallback."""
    tokens = set(vocab)
    for t in TEMPLATES.values():
        if t.detect_tokens and all(tok in tokens for tok in t.detect_tokens):
            return t
    return TEMPLATES[FALLBACK_TEMPLATE]


def resolve_template(name: str, vocab: Iterable[str] | None = None) -> FimTemplate:
    """``auto`` detects from the vocabulary; anything else is looked up by name."""
    if name.strip().lower() == "auto":
        return detect_template(vocab or ())
    return get_template(name)


def detect_from_prompt(prompt: str, prefer: str | None = None) -> FimTemplate:
    """The template that rendered ``prompt``: ``prefer`` first, then every token template, then prefix-only."""
    order = [TEMPLATES[prefer]] if prefer in TEMPLATES else []
    order += [t for t in TEMPLATES.values() if t.detect_tokens and t not in order]
    order += [TEMPLATES["plain"]]
    for t in order:
        if t.matches(prompt):
            return t
    return TEMPLATES["prefix-only"]


def split_prompt(prompt: str, prefer: str | None = None) -> tuple[str, str, str]:
    """``(template_name, prefix, suffix)`` recovered from a client-rendered prompt."""
    t = detect_from_prompt(prompt, prefer)
    prefix, suffix = t.parse(prompt)
    return t.name, prefix, suffix
