"""Qwen's real vocabulary in the tests (tests/fixtures/qwen.py): the fast tokenizer built from qwen.tiktoken's ranks
gives exactly tiktoken's own ids for the same ranks, Qwen2's pattern and the added tokens, on math, code, LaTeX and
non-ASCII text; it decodes back to the text; the added tokens have Qwen3's published ids."""

import unicodedata

import pytest

from rstar2.rollout.chat import prompt_messages
from rstar2.rollout.template import TOOL_SCHEMA
from tests.fixtures.qwen import QWEN_TEMPLATE, VOCAB_SIZE, make_tokenizer, tiktoken_encoding

# Qwen3's tokenizer_config.json (`added_tokens_decoder`), written out here rather than read from the fixture
QWEN3_ADDED = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
    "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666,
    "<think>": 151667, "</think>": 151668,
}

CORPUS = [
    "Compute the product of 47 and 83 with Python, then put the answer in a box.",
    "1234567 + 89 = 1234656, and 3.14159 * 2 = 6.28318; 10^{12} = 1000000000000.",
    "Let $f(x) = \\frac{x^2 - 1}{x + 1}$. Then $\\lim_{x \\to -1} f(x) = -2$, so \\boxed{-2}.",
    "<reason>The sum is \\sum_{k=1}^{100} k = \\frac{100 \\cdot 101}{2}.</reason> <answer>\\boxed{5050}</answer>",
    "\\begin{align*} a &= \\sqrt{b^2 - 4ac} \\\\ \\int_0^1 x\\,dx &= \\tfrac12 \\end{align*}",
    "def f(n):\n    total = 0\n    for i in range(1, n + 1):\n        total += i ** 2\n"
    "    return total\n\n\nprint(f(10))\n",
    "import sys\nfor line in sys.stdin:\n\tprint(int(line) * 2)  # tab-indented\r\n",
    "Tool call success\nstdout: 5050\n\n",
    'Traceback (most recent call last):\n  File "<string>", line 1\nZeroDivisionError: division by zero',
    '{"name": "python_code_with_standard_io", "arguments": {"code": "print(6 * 7)", "input": ""}}',
    "求和：1 + 2 + ... + 100 = 5050。答案是 \\boxed{5050}。",
    "Ünïcödé àccents: café, naïve, Ångström, Straße, Đorđe; ελληνικά, русский, العربية, 日本語のテキスト, 한국어.",
    "Emoji: 🙂🎉 👩‍👩‍👧 ✅ — dashes – and “quotes” ‘too’ … ∑ ∫ √ ≤ ≥ ≠ π ∞",
    "   leading spaces, trailing spaces   \n\n\n\t\t mixed \t whitespace    runs\n \n",
    "I'm sure it's the user's answer; they'll say we've done it, I'd think. IT'S LOUD. We'RE here.",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def enc():
    return tiktoken_encoding()


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_ids_are_tiktokens_and_decode_gives_the_text_back(tok, enc, text):
    ids = _ids(tok, text)
    assert ids == enc.encode_ordinary(text)
    assert tok.decode(ids) == text
    assert all(i < 151643 for i in ids)  # ordinary text never makes an added token


def test_the_paper_prompt_rendered_by_the_template_is_tiktokens_too(tok, enc):
    text = tok.apply_chat_template(prompt_messages("What is 6 * 7?"), tools=[TOOL_SCHEMA], add_generation_prompt=True,
                                   tokenize=False)
    ids = _ids(tok, text)
    assert ids == enc.encode(text, allowed_special="all")
    assert tok.decode(ids) == text
    assert ids[:3] == [151644, 8948, 198]  # <|im_start|> system \n, Qwen's own ids


def test_added_tokens_have_qwen3s_ids_and_are_single_tokens_in_text(tok, enc):
    assert len(tok) == 151669 and VOCAB_SIZE == 151936
    assert tok.get_added_vocab() == QWEN3_ADDED
    assert {t: tok.convert_tokens_to_ids(t) for t in QWEN3_ADDED} == QWEN3_ADDED
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|endoftext|>", "<|endoftext|>", None)
    text = "".join(f"x{t} y" for t in QWEN3_ADDED)
    ids = _ids(tok, text)
    assert ids == enc.encode(text, allowed_special="all")
    assert [i for i in ids if i >= 151643] == list(QWEN3_ADDED.values())
    assert tok.decode(ids) == text
    assert tok.chat_template == QWEN_TEMPLATE


def test_numbers_split_into_digits_and_known_qwen_ids(tok):
    assert _ids(tok, "1234567") == [16, 17, 18, 19, 20, 21, 22]  # "0" .. "9" are ids 15 .. 24
    assert _ids(tok, "Hello world") == [9707, 1879]
    assert _ids(tok, "<|im_start|>assistant\n") == [151644, 77091, 198]
    assert _ids(tok, "\n\n") == [271]


def test_text_is_nfc_normalised_as_in_qwens_tokenizer(tok, enc):
    decomposed = "cafe\u0301 = cafe\u0301"  # e + combining acute accent
    nfc = unicodedata.normalize("NFC", decomposed)
    assert nfc != decomposed and _ids(tok, decomposed) == _ids(tok, nfc) == enc.encode_ordinary(nfc)
