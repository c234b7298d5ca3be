"""Every code block of README.md and docs/*.md runs as written, on the pinned versions, or is marked as an
illustration (``tests/support/snippets.py`` has the convention and the context a page runs in).

One small context (caches, input files, a tokenizer) is made once for the module; each page then runs in its
own process and work directory, its blocks in order.
"""

from __future__ import annotations

import pytest

import snippets

PAGES = {str(p.relative_to(snippets.REPO)): snippets.blocks(p) for p in snippets.pages()}
# Pages that run several real builds each, or DataLoader worker processes: make test runs them, not test-fast.
SLOW_PAGES = ("docs/RUNNING.md", "docs/SFT.md", "docs/TORCH.md")
RUNNABLE = [pytest.param(page, marks=[pytest.mark.slow] * (page in SLOW_PAGES)) for page, bs in PAGES.items()
            if any(b.runs for b in bs)]


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    return snippets.make_context(tmp_path_factory.mktemp("snippets"))


def test_every_block_declares_what_it_is():
    assert [p for bs in PAGES.values() for b in bs for p in snippets.problems(b)] == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", RUNNABLE)
def test_the_page_runs(context, page):
    results = snippets.run_page(context, PAGES[page])
    assert len(results) == sum(b.runs for b in PAGES[page])
    failed = [f"{r['where']} ({r['kind']}, {r['seconds']} s):\n{r['error']}" for r in results if r["error"]]
    assert not failed, "\n\n".join(failed)
