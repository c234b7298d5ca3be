"""pipelines/tokenize/sft.py's chat encoding equals transformers' ``apply_chat_template``, token for token and mask for
mask, on seeded conversations (unicode, empty turns, system messages, assistant-first), for templates with
generation marks and, through the assistant-span fallback, without them; with both encoders.

Conversations whose content holds a special-token string are left out of the equality (transformers turns
them into special ids, on purpose we do not) and checked on their own: same text and loss spans as
transformers renders, the string's ordinary tokens, never a special id.
"""

from __future__ import annotations

import random

import pytest
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

from pipelines.tokenize import sft
from pipelines.tokenize import sft_encoders
from sftgen import (BOS, CHAT_ADDED, CHAT_SPECIALS, CHATML, EOS, FEATURES, LLAMA3, PIECES, ZEPHYR, chat_tiktoken,
                    chat_tokenizer_json, conversations, with_special_strings, without_marks)

pytestmark = pytest.mark.slow  # against transformers' own rendering, token for token: make test only

# name -> (our template, the template transformers masks with: the same text, with generation marks)
TEMPLATES = {
    "chatml": (CHATML, CHATML),
    "llama3": (LLAMA3, LLAMA3),
    "features": (FEATURES, FEATURES),
    "zephyr_no_marks": (without_marks(ZEPHYR), ZEPHYR),
    "llama3_no_marks": (without_marks(LLAMA3), LLAMA3),
}
ALL_SPECIALS = ["<|endoftext|>", "<|endofprompt|>"] + CHAT_SPECIALS + CHAT_ADDED
N = 300


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return chat_tokenizer_json(tmp_path_factory.mktemp("sft-hf"))


@pytest.fixture(scope="module")
def hf(tok_path):
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_path), bos_token=BOS, eos_token=EOS)


@pytest.fixture(scope="module")
def tokenizer(tok_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_path))


@pytest.fixture(scope="module")
def encoders(tokenizer):
    """``encoders(kind, template)``: the HF encoder's control tokens depend on the template, tiktoken's not."""
    tt, hf_by_template = sft_encoders.TiktokenSft(chat_tiktoken()), {}

    def get(kind, template):
        if kind == "tiktoken":
            return tt
        if template not in hf_by_template:
            hf_by_template[template] = sft_encoders.HFSft(tokenizer, template)
        return hf_by_template[template]

    return get


def has_special(msgs):
    return any(s in m["content"] for m in msgs for s in ALL_SPECIALS)


def reference(hf, msgs, template):
    out = hf.apply_chat_template(msgs, chat_template=template, tokenize=True, return_assistant_tokens_mask=True,
                                 return_dict=True)
    return out["input_ids"], [bool(x) for x in out["assistant_masks"]]


@pytest.mark.slow
def test_control_tokens_are_the_special_ones_and_the_added_ones_the_template_writes(encoders, tokenizer, hf):
    specials = set(ALL_SPECIALS) - set(CHAT_ADDED) | {"<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"}
    assert set(sft_encoders.HFSft(tokenizer).special_ids) == specials
    assert set(encoders("hf", LLAMA3).special_ids) == specials
    assert encoders("hf", CHATML).special_ids == encoders("tiktoken", None).special_ids  # writes <think>
    assert set(encoders("hf", CHATML).special_ids) == specials | set(CHAT_ADDED)
    assert encoders("hf", CHATML).special_ids[EOS] == hf.eos_token_id == 100257


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_chat_tokens_and_masks_equal_transformers(name, kind, hf, encoders):
    ours, theirs = TEMPLATES[name]
    compared = no_loss = template_errors = 0
    for msgs in conversations(N, seed=7):
        if has_special(msgs):
            continue
        ids_ref, mask_ref = reference(hf, msgs, theirs)
        if name.endswith("no_marks"):  # the marks do not change the text
            assert hf.apply_chat_template(msgs, chat_template=ours)["input_ids"] == ids_ref
        try:
            ids, mask = sft.encode_chat({"messages": msgs}, ours, encoders(kind, ours), bos_token=BOS,
                                        eos_token=EOS)
        except sft.BadRecord as e:
            if not any(mask_ref):
                assert e.reason == "no_loss_tokens"
                no_loss += 1
                continue
            # Llama 3's template reads messages[0] unguarded: the fallback's render of the empty conversation
            # before an assistant-first one fails.
            assert (name, e.reason, msgs[0]["role"]) == ("llama3_no_marks", "template_error", "assistant"), e
            template_errors += 1
            continue
        assert ids.dtype.name == "int32" and mask.dtype == bool
        assert ids.tolist() == ids_ref, msgs
        assert mask.tolist() == mask_ref, msgs
        compared += 1
    assert compared >= 250, (compared, no_loss, template_errors)
    if name == "llama3_no_marks":
        assert template_errors > 0


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_rendered_text_and_loss_spans_equal_transformers_with_and_without_special_strings(name, encoders):
    ours, theirs = TEMPLATES[name]
    rng = random.Random(11)
    checked = 0
    for msgs in conversations(N, seed=8):
        for m in (msgs, with_special_strings(msgs, rng, ALL_SPECIALS)):
            (text,), (spans,) = render_jinja_template([m], chat_template=theirs, return_assistant_tokens_mask=True,
                                                      bos_token=BOS, eos_token=EOS)
            try:
                r = sft.render_chat(m, ours, bos_token=BOS, eos_token=EOS,
                                    special_tokens=tuple(encoders("hf", ours).special_ids))
            except sft.BadRecord as e:
                assert (name, e.reason, m[0]["role"]) == ("llama3_no_marks", "template_error", "assistant")
                continue
            assert r.text == text
            assert list(r.loss_spans) == [tuple(s) for s in spans]
            checked += 1
    assert checked >= 2 * N - 80


def template_written(hf, msgs, template, specials):
    """Spans of the specials the template writes: those of the render with every special-token string of
    the content replaced by as many '@' (our test templates do not look at the content's characters)."""
    import re

    neutral = [dict(m, content=re.sub("|".join(map(re.escape, specials)), lambda x: "@" * len(x.group(0)),
                                      m["content"])) for m in msgs]
    text = hf.apply_chat_template(neutral, chat_template=template, tokenize=False)
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    return [m.span() for m in pattern.finditer(text)]


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
@pytest.mark.parametrize("name", ["chatml", "llama3", "zephyr_no_marks"])
def test_special_strings_in_content_stay_ordinary_text(name, kind, hf, encoders):
    ours, theirs = TEMPLATES[name]
    enc = encoders(kind, ours)
    ordinary = (hf._encode_without_added_tokens if kind == "hf" else enc.enc.encode_ordinary)
    control = [s for s in ALL_SPECIALS if s in enc.special_ids]  # LLAMA3 does not write <think>: not control
    rng = random.Random(5)
    checked = 0
    for msgs in conversations(150, seed=9):
        msgs = with_special_strings(msgs, rng, control)
        text = hf.apply_chat_template(msgs, chat_template=theirs, tokenize=False)
        try:
            ids, mask = sft.encode_chat({"messages": msgs}, ours, enc, bos_token=BOS, eos_token=EOS)
        except sft.BadRecord as e:
            assert e.reason in ("no_loss_tokens", "template_error"), e
            continue
        expected, pos = [], 0
        written = template_written(hf, msgs, theirs, control)
        for s, e in written + [(len(text), len(text))]:
            expected += ordinary(text[pos:s]) if s > pos else []
            expected += [enc.special_ids[text[s:e]]] if e > s else []
            pos = e
        assert ids.tolist() == expected, msgs
        special = set(enc.special_ids.values())
        assert sum(t in special for t in ids.tolist()) == len(written)
        # transformers makes a special id of every special-token string in the text
        assert sum(t in special for t in reference(hf, msgs, theirs)[0]) > len(written)
        checked += 1
    assert checked >= 120


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES + ALL_SPECIALS) for _ in range(rng.randint(0, 8)))


def test_ordinary_encoding_and_prompt_completion_with_a_tokenizer_json(tok_path, hf):
    """Special tokens are text; the other added tokens (<think>) are matched, as transformers encodes with
    ``split_special_tokens=True``."""
    from tokenizers import Tokenizer

    truncating = Tokenizer.from_file(str(tok_path))
    truncating.enable_truncation(8)  # a tokenizer.json may carry a truncation setting: never applied here
    enc = sft_encoders.HFSft(truncating)
    rng = random.Random(12)
    added = 0
    for _ in range(300):
        prompt, completion = random_text(rng), random_text(rng) or "x"
        p, c = (hf(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] for t in (prompt, completion))
        added += 100283 in p + c
        assert enc.encode_ordinary(prompt) == p
        ids, mask = sft.encode_prompt_completion(prompt, completion, enc, hf.eos_token_id)
        assert ids.tolist() == p + c + [hf.eos_token_id]
        assert mask.tolist() == [False] * len(p) + [True] * (len(c) + 1)
    assert added > 20


def test_token_offsets_from_bytes_equal_the_hf_tokenizers_offsets(encoders):
    """The tiktoken encoder's offsets (from token bytes) are the HF tokenizer's (the ones transformers' mask
    reads), also for tokens that split a multi-byte character: same ids, the HF tokenizer is cl100k."""
    rng = random.Random(13)
    split_chars = ascii = 0
    for _ in range(500):
        text = random_text(rng)
        ids, starts, ends = encoders("tiktoken", None).encode_with_offsets(text)
        hf_ids, hf_starts, hf_ends = encoders("hf", CHATML).encode_with_offsets(text)
        assert (list(map(int, ids)), list(map(int, starts)), list(map(int, ends))) == (hf_ids, hf_starts, hf_ends)
        split_chars += len(set(zip(hf_starts, hf_ends))) < len(hf_ids)
        ascii += text.isascii()
    assert split_chars > 50 and ascii > 50


def test_added_tokens_the_template_does_not_write_are_matched_in_content_as_transformers_does(hf, encoders):
    msgs = [{"role": "user", "content": "think: <think>"}, {"role": "assistant", "content": "<think>x</think>y"}]
    ids_ref, mask_ref = reference(hf, msgs, LLAMA3)
    ids, mask = sft.encode_chat({"messages": msgs}, LLAMA3, encoders("hf", LLAMA3), bos_token=BOS, eos_token=EOS)
    assert (ids.tolist(), mask.tolist()) == (ids_ref, mask_ref) and ids.tolist().count(100283) == 2
    # a template that writes <think> makes it a control token: text in content
    ids, _ = sft.encode_chat({"messages": msgs}, CHATML, encoders("hf", CHATML), bos_token=BOS, eos_token=EOS)
    assert ids.tolist().count(100283) == 1  # the template's own, before the answer
