"""The one Continue configuration we print: `onlinerl up`'s banner, the operator's status, README and docs.

It is a complete ``config.yaml`` that stock Continue (the marketplace extension) loads: ``parseConfigYaml`` of the
published npm package ``@continuedev/config-yaml`` refuses a file without ``name`` and ``version``, and its schema
silently drops ``config.json`` keys such as ``tabAutocompleteOptions`` (tests/continue/ loads what we print with that
very package). Two parts matter to the loop:

* the model, with ``roles: [autocomplete]``, its FIM template when Continue cannot pick it from the model name, and a
  prompt budget the served context holds (``continue_budget``);
* a ``data:`` destination: Continue's ``DataLogger`` POSTs every accept and reject to the feedback service's
  ``/api/training/data`` (schema 0.2.0, level all, autocomplete events only, with the key as a bearer token).

The RLinf Continue fork's ``completionTrackingUrl`` is mentioned only in a trailing comment, for that fork's users.
Pure text: the callers say where the services are and which key to show.
"""

from __future__ import annotations

import json

from onlinerl.fim import FimTemplate

DATA_PATH = "/api/training/data"  # services/feedback/onlinerl_feedback/openapi.py DATA_PATH
SUBMIT_PATH = "/api/training/submit"
CONFIG_PATH = "~/.continue/config.yaml"
# Continue counts prompt tokens with its own tokenizer (not the served model's): a code prompt of N of its tokens is
# up to about 1.3 N of SmolLM2's or Qwen's. Two thirds of what is left after the completion keeps the rendered FIM
# prompt (plus its few special tokens) inside the served context.
CONTINUE_MAX_PROMPT_TOKENS = 1024  # Continue's default maxPromptTokens: never ask for more than it would send


def continue_budget(max_model_len: int) -> tuple[int, int]:
    """``(maxPromptTokens, maxTokens)`` for a served context of ``max_model_len`` tokens: Continue renders a prompt of
    up to maxPromptTokens and asks for maxTokens on top, and vLLM refuses (400) a request over its context. The cpu
    profile's 1,024 tokens give (640, 64): Continue's default 1,024-token prompt alone would fill it."""
    max_tokens = 64 if max_model_len <= 1024 else 128
    prompt = (max_model_len - max_tokens) * 2 // 3 // 32 * 32  # integer: the chart's NOTES compute it the same way
    return min(CONTINUE_MAX_PROMPT_TOKENS, prompt), max_tokens


def continue_knows(template: FimTemplate, model: str) -> bool:
    """Whether Continue renders ``template`` by itself: it picks a FIM template by the model *name*, and a name with
    "qwen" and "coder" gets exactly our qwen template. Any other name (``onlinerl-base``) needs the template spelled."""
    name = model.lower()
    return template.name == "qwen" and "qwen" in name and "coder" in name


def template_lines(template: FimTemplate | None, model: str = "") -> str:
    """The model's ``stop`` and ``promptTemplates`` lines, unless Continue renders the template itself
    (``continue_knows``) or the template is not known here (None: Continue's choice by name stands)."""
    if template is None or continue_knows(template, model):
        return ""
    if template.prefix_only:
        tpl = "{{{prefix}}}"
    elif template.suffix_first:
        tpl = f"{template.begin}{{{{{{suffix}}}}}}{template.hole}{{{{{{prefix}}}}}}"
    else:
        tpl = f"{template.begin}{{{{{{prefix}}}}}}{template.hole}{{{{{{suffix}}}}}}{template.end}"
    stops = ", ".join(json.dumps(s) for s in template.stop)
    return f"      stop: [{stops}]\n    promptTemplates:\n      autocomplete: {json.dumps(tpl)}\n"


def continue_config(
    *,
    model: str,
    api_base: str,
    feedback_base: str,
    api_key: str,
    max_model_len: int,
    template: FimTemplate | None = None,
) -> str:
    """``config.yaml`` for stock Continue: ``api_base`` ends in ``/v1``; ``feedback_base`` is the feedback service's
    (or the ingress's) base URL, without a path."""
    max_prompt, max_tokens = continue_budget(max_model_len)
    return f"""# onlinerl for stock Continue. Merge into {CONFIG_PATH}: add the model under your `models:` and the
# entry under your `data:` (keep your own name, version and other models); with no config yet, save this as that file.
name: onlinerl
version: 1.0.0
schema: v1
models:
  - name: onlinerl-autocomplete
    provider: openai
    model: {model}
    apiBase: {api_base}
    apiKey: {api_key}
    roles:
      - autocomplete
    autocompleteOptions:
      maxPromptTokens: {max_prompt}
    defaultCompletionOptions:
      maxTokens: {max_tokens}
{template_lines(template, model)}data:
  - name: onlinerl-feedback
    destination: {feedback_base}{DATA_PATH}
    schema: 0.2.0
    level: all
    events:
      - autocomplete
    apiKey: {api_key}
# Only for the RLinf Continue fork (config.json's tabAutocompleteOptions), instead of data: above:
#   enableCompletionTracking: true, completionTrackingUrl: {feedback_base}{SUBMIT_PATH},
#   completionTrackingHeaders: {{Authorization: "Bearer {api_key}"}}
"""


__all__ = ["CONFIG_PATH", "DATA_PATH", "continue_budget", "continue_config", "template_lines"]
