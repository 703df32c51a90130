"""FIM registry: every template round-trips, Qwen matches Continue byte for byte, detection works."""

import pytest

from onlinerl.fim import TEMPLATES, Snippet, detect_from_prompt, detect_template, get_template, split_prompt

CASES = [
    ("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"),
    ("", "x = 1\n"),
    ("import os\n", ""),
    ("s = '<|fim_suffix|> in a string'\n", "# unicode: é ✓ \n"),
]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize(("prefix", "suffix"), CASES)
def test_round_trip_every_template(name, prefix, suffix):
    t = TEMPLATES[name]
    prompt = t.render(prefix, suffix)
    got_prefix, got_suffix = t.parse(prompt)
    assert got_prefix == prefix
    assert got_suffix == ("" if t.prefix_only else suffix)


def test_qwen_renders_exactly_what_continue_sends():
    prompt = get_template("qwen").render("def f():\n    return ", "\n")
    assert prompt == "<|fim_prefix|>def f():\n    return <|fim_suffix|>\n<|fim_middle|>"
    assert get_template("qwen").stop == (
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


def test_qwen_repo_level_prompt_parses_to_current_file():
    t = get_template("qwen")
    prompt = t.render("x = ", "\n", repo_name="acme", filepath="a/b.py", snippets=[Snippet("a/c.py", "y = 2")])
    assert prompt == (
        "<|repo_name|>acme\n<|file_sep|>a/c.py\ny = 2\n<|file_sep|>a/b.py\n"
        "<|fim_prefix|>x = <|fim_suffix|>\n<|fim_middle|>"
    )
    assert split_prompt(prompt) == ("qwen", "x = ", "\n")


@pytest.mark.parametrize("name", ["qwen", "starcoder", "santacoder", "codellama", "deepseek", "plain"])
def test_detect_from_prompt(name):
    prompt = TEMPLATES[name].render("a = ", "\nb = 2")
    assert detect_from_prompt(prompt).name == name
    assert split_prompt(prompt)[1:] == ("a = ", "\nb = 2")


def test_unknown_prompt_is_prefix_only():
    assert split_prompt("just code") == ("prefix-only", "just code", "")


@pytest.mark.parametrize(
    ("vocab", "expected"),
    [
        ({"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "a"}, "qwen"),
        ({"<fim_prefix>", "<fim_suffix>", "<fim_middle>"}, "starcoder"),
        ({"<fim-prefix>", "<fim-suffix>", "<fim-middle>"}, "santacoder"),
        ({"▁<PRE>", "▁<SUF>", "▁<MID>"}, "codellama"),
        ({"<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"}, "deepseek"),
        ({"hello", "<|im_end|>"}, "plain"),
    ],
)
def test_detect_from_vocabulary(vocab, expected):
    assert detect_template(vocab).name == expected


def test_detect_from_real_smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(smollm2_path).get_vocab()
    assert detect_template(vocab).name == "plain"  # SmolLM2 has no FIM tokens


def test_unknown_template_lists_known_ones():
    with pytest.raises(KeyError, match="known: codellama"):
        get_template("nope")
    assert get_template("Qwen2.5-Coder").name == "qwen"
