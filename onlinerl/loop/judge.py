"""Optional LLM judge (the seed's rubric): scores a completion 0-10 without showing the reference.

Works against any OpenAI-compatible chat endpoint. Scores are snapped to the rubric's levels {0, 3, 6, 8, 10}.
"""

from __future__ import annotations

import re

import httpx

RUBRIC_LEVELS = (0, 3, 6, 8, 10)
JUDGE_PROMPT = """You are reviewing a code completion suggested by an editor at the cursor position.
Score how useful the suggestion is for the code around it, using exactly one of these scores:
10 = correct and exactly what belongs here; 8 = correct, minor issues; 6 = partially right or needs edits;
3 = mostly wrong but related; 0 = wrong, empty, or harmful.

Code before the cursor:
```python
{prefix}
```
Code after the cursor:
```python
{suffix}
```
Suggested completion:
```python
{completion}
```
Answer with the score only, as: SCORE: <number>"""


def snap(score: float) -> int:
    return min(RUBRIC_LEVELS, key=lambda level: abs(level - score))


def parse_score(text: str) -> int | None:
    m = re.search(r"SCORE:\s*(\d+(?:\.\d+)?)", text, re.IGNORECASE) or re.search(r"\b(\d+(?:\.\d+)?)\b", text)
    if not m:
        return None
    value = float(m.group(1))
    return snap(value) if 0 <= value <= 10 else None


async def judge(
    http: httpx.AsyncClient, base_url: str, model: str, api_key: str, prefix: str, suffix: str, completion: str
) -> int | None:
    """One judgement; None when the judge's answer holds no score (counted separately, never as 0)."""
    body = {
        "model": model,
        "temperature": 0.0,
        "max_tokens": 16,
        "messages": [
            {
                "role": "user",
                "content": JUDGE_PROMPT.format(prefix=prefix[-1500:], suffix=suffix[:500], completion=completion),
            }
        ],
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = await http.post(f"{base_url.rstrip('/')}/chat/completions", json=body, headers=headers)
    r.raise_for_status()
    return parse_score(r.json()["choices"][0]["message"]["content"] or "")
