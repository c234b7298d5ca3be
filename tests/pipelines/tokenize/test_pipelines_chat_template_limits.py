"""Chat templates run under limits (pipelines/tokenize/chat_template.py): the work of a record's renders, the
size of every value a template builds and of its render. A template that breaks a limit is that record's
bad record, in seconds and bounded memory, never a hang; nothing unbounded is folded at compile time; a
10,000-turn conversation is far inside the defaults. The hostile templates run in a child process capped at
3 GiB of address space (a regression fails there, not the machine), each record timed."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from pipelines.tokenize import chat_template, sandbox, sft, sft_encoders
from sftgen import CHATML, content

HOSTILE = {
    "folded power": "{{ (10 ** (10 ** 10)) % 7 }}",
    "folded repeat": "{{ 'a' * 10000000000 }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "100 MB of output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling a list": "{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "padding": "{{ '{:>1000000000}'.format(1) }}{{ '%*d' % (1000000000, 1) }}",
    "a filter's width": "{{ 'a' | center(1000000000) }}",
    "tabs": "{{ ('\t' * 1000).expandtabs(30000000) }}",
    "replacing": "{% set ns = namespace(s='aaaaaaaaaa') %}{% for i in range(20) %}{% set ns.s = ns.s.replace('a', ns.s)"
                 " %}{% endfor %}",
    "recursion": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "lipsum": "{{ lipsum(10000000) }}",
}
CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from pipelines.tokenize import chat_template, sandbox, sft, sft_encoders
from pipelines.tokenize.tokenizer import resolve
tt = sft_encoders.TiktokenSft(resolve("tiktoken:cl100k_base").load_reference().enc)
record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
for name, source in json.loads(sys.argv[1]).items():
    t0 = time.time()
    try:
        chat_template.compile_template(source)
        compiled = time.time() - t0
        sft.encode_chat(record, source, tt, max_bytes=32 << 20)
        got = ["ok", ""]
    except sft.BadRecord as e:
        got = [e.reason, e.detail]
    except Exception as e:
        got = [type(e).__name__, str(e)]
    print("RESULT " + json.dumps([name, got, compiled if "compiled" in dir() else None, time.time() - t0]), flush=True)
"""


def test_hostile_templates_are_bad_records_in_seconds_and_bounded_memory():
    """The sandbox stopped the escapes but nothing bounded CPU, memory or output: nested range(100000) loops
    hung the build, ``{{ (10 ** (10 ** 10)) % 7 }}`` hung the launcher at compile (Jinja folded it), ``'a' *
    10000000000`` took 3.4 GB at compile, 100 MB of output per record exited 0 with 25 M-token documents."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(HOSTILE)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, MALLOC_ARENA_MAX="2"))
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
    got = {name: (result, compiled, seconds) for name, result, compiled, seconds in
           (json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if line.startswith("RESULT "))}
    assert set(got) == set(HOSTILE), f"{len(got)} of {len(HOSTILE)} ended (a hang?): {err[-2000:]}"
    for name, ((reason, detail), compiled, seconds) in got.items():
        want = "too_long" if name == "100 MB of output" else "template_error"
        assert reason == want and "\n" not in detail, (name, reason, detail)
        assert compiled < 1 and seconds < 30, (name, compiled, seconds)
    assert "steps of work on this record" in got["nested loops"][0][1]
    assert got["100 MB of output"][0][1].startswith("the rendered conversation is over max_doc_bytes 33554432")
    assert "an integer of about 40,000,000,000 bits" in got["folded power"][0][1]


def test_a_long_legitimate_conversation_is_far_inside_the_limits():
    """A 10,000-turn conversation with generation marks: about 200,000 steps of the 20 million a record may take."""
    rng = random.Random(5)
    msgs = [{"role": ("user", "assistant")[i % 2], "content": content(rng)} for i in range(10_000)]
    with sandbox.budget(32 << 20) as b:
        r = sft.render_chat(msgs, CHATML, special_tokens=("<|im_start|>", "<|im_end|>"))
    assert len(r.loss_spans) == 5000 and sandbox.MAX_WORK - b.work < sandbox.MAX_WORK // 50


def test_the_limits_hold_for_a_whole_record_not_each_render():
    """Every render of a record (the prefix renders of a template without marks too) draws on one budget."""
    loop = "{% for i in range(3000) %}{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    msgs = [{"role": "assistant", "content": "a"}] * 3
    with sandbox.budget(work=5000) as b:
        chat_template.render(loop, {"messages": msgs})
    assert 3000 < 5000 - b.work < 3200
    with sandbox.budget(work=5000):
        try:
            sft.render_chat(msgs, loop, special_tokens=())
        except sft.BadRecord as e:
            assert e.reason == "template_error" and "steps of work" in e.detail
        else:
            raise AssertionError("the renders of one record each had a budget of their own")
