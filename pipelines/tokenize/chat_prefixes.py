"""The prefix renders of a chat template without generation marks, in time linear in the turns.

:mod:`pipelines.tokenize.sft`'s rule (docs/SFT.md): the loss span of assistant message ``i`` runs from the
end of render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i+1]), both prefixes
of the whole render. Rendering every prefix costs 1 + 2 x (assistant messages) renders per record: a
10,000-turn record took 38 s. Here one render of the whole conversation with its messages tracked
(:class:`_Tracked`: each thing the template learns of them is logged with how much it had written) tells
most prefix renders at once, where the template reads the conversation front to back in one loop (ChatML,
Zephyr, Llama's and the like: see :func:`_prefix_renders`); any other prefix is rendered whole. The last
assistant message's two prefixes are always rendered whole too, and must equal what was told (else all
are rendered), so a way of writing the trace does not see (a loop inside a macro) costs time, never a
wrong span. Texts are compared as a shared whole render's head plus a tail (:class:`_Text`), so the checks
cost the tails, not the lengths.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from pipelines.tokenize import sandbox

Render = Callable[[Any, bool], str]  # (messages, add_generation_prompt) -> the render (raises on failure)


class Unlocated(Exception):
    """Message ``message``'s prefix renders are not prefixes of the whole one (its text cannot be located)."""

    def __init__(self, message: int):
        super().__init__(message)
        self.message = message


class _Unread(Exception):
    """A tracked conversation was used otherwise than a reading of its messages (the renders fall back)."""


class _Tracked:
    """The ``messages`` of a tracked render (:func:`_prefix_renders`): what a list of them does for reading,
    each time logging into the record's trace what the template learned that the render of a shorter
    conversation would not: ``("fetch", iterator, j)`` an iteration's step to message ``j`` (``j = n``: the
    end), ``("look", t)`` anything else that differs for conversations of ``t`` messages or fewer (a length,
    an item by index, a truth value). Whatever else a list can do raises :class:`_Unread`."""

    __slots__ = ("_items", "_budget", "_iters")

    def __init__(self, items: list, budget: sandbox.Budget):
        self._items, self._budget, self._iters = items, budget, 0

    def _log(self, *event) -> None:
        self._budget.trace.append((*event, self._budget.emitted))

    def __iter__(self):
        self._iters += 1
        return _TrackedIter(self, self._iters)

    def __len__(self) -> int:
        self._log("look", len(self._items) - 1)
        return len(self._items)

    def __bool__(self) -> bool:
        self._log("look", 0)
        return bool(self._items)

    def __getitem__(self, i):
        n = len(self._items)
        if type(i) is int:
            self._log("look", i if 0 <= i < n else n - 1)
            return self._items[i]
        if isinstance(i, slice):
            self._log("look", n - 1)
            return self._items[i]
        raise _Unread(f"messages[{i!r}]")

    def __reversed__(self):
        self._log("look", len(self._items) - 1)
        return reversed(self._items)

    def __contains__(self, x) -> bool:
        self._log("look", len(self._items) - 1)
        return x in self._items

    def __getattr__(self, name):
        raise _Unread(f"messages.{name}")

    def __str__(self):
        raise _Unread("str(messages)")

    __repr__ = __str__

    def __eq__(self, other):
        raise _Unread("messages ==")

    __hash__ = None


class _TrackedIter:
    __slots__ = ("_seq", "_id", "_j")

    def __init__(self, seq: _Tracked, ident: int):
        self._seq, self._id, self._j = seq, ident, 0

    def __iter__(self):
        return self

    def __next__(self):
        items = self._seq._items
        self._seq._log("fetch", self._id, min(self._j, len(items)))  # every call: a loop's end is logged too
        if self._j >= len(items):
            raise StopIteration
        self._j += 1
        return items[self._j - 1]


def _common_prefix(a: str, c: str) -> int:
    """How many first characters ``a`` and ``c`` share (compared in slices: C speed)."""
    lo, hi = 0, min(len(a), len(c))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == c[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Text:
    """A render as ``base[:head] + tail`` (``base`` a whole render's text, shared by many), so comparing one
    with another costs about its tail, not its length (linear in the turns, not quadratic)."""

    __slots__ = ("base", "head", "tail")

    def __init__(self, base: str, head: int | None = None, tail: str = ""):
        self.base, self.head, self.tail = base, len(base) if head is None else head, tail

    def __len__(self) -> int:
        return self.head + len(self.tail)

    def __str__(self) -> str:
        return self.base[:self.head] + self.tail

    def window(self, i: int, j: int) -> str:
        h = self.head
        return self.base[i:min(j, h)] + self.tail[max(i - h, 0):max(j - h, 0)]

    def starts_with(self, other: "_Text", common) -> bool:
        """Whether this text starts with ``other``; ``common(a, b)``: how many first characters the bases
        ``a`` and ``b`` are known to share (None: unknown)."""
        h = other.head
        if h + len(other.tail) > len(self):
            return False
        known = common(self.base, other.base)
        if not (h <= self.head and known is not None and h <= known) and self.window(0, h) != other.base[:h]:
            return False
        return self.window(h, h + len(other.tail)) == other.tail


def _prefix_renders(render_whole: Render, messages: list, agp: bool):
    """``(text, k -> (head, tail))``: a render of the whole conversation with tracked messages, and for the
    ``k`` it tells, render(messages[:k], agp) as ``text[:head] + tail`` (None for the others); None if the
    template used the messages otherwise than by reading them.

    The template is a program reading ``messages`` only through :class:`_Tracked`, so a render of the first
    ``k`` messages writes what the whole one wrote up to the first thing it learned that differs for ``k``
    messages. Where that is the step of the loop over the messages to message ``k`` (followed by that
    loop's body, nothing written between), the shorter render ends the loop there and goes on as the whole
    one goes on after its loop, provided the loop's end is the iterator's end followed at once by the loop's
    end mark, no namespace changed in the later bodies, and nothing after the loop reads the messages: it is
    the whole render's text before that step and after the loop.
    """
    b = sandbox.current()
    trace, saved = [], b.trace
    b.trace, start = trace, b.emitted
    try:
        out = render_whole(_Tracked(messages, b), agp)
    except Exception:  # noqa: BLE001 - any failure: every prefix is rendered whole (and fails there, if it must)
        return None
    finally:
        b.trace = saved
    events = [(*e[:-1], e[-1] - start) for e in trace]
    n = len(messages)
    ends = {}  # iterator -> (index of its loop's end mark, where the loop ended)
    for x, e in enumerate(events[:-1]):
        after = events[x + 1]
        if e[0] == "fetch" and e[2] == n and after[0] == "end" and after[2] == e[3]:
            ends[e[1]] = (x + 1, e[3])
    last_read = max((x for x, e in enumerate(events) if e[0] in ("fetch", "look")), default=-1)
    # first[k]: the first read a render of k messages learns otherwise from (a read of t: iff k <= t)
    first = [len(events)] * (n + 1)
    for x, e in enumerate(events):
        t = e[2] if e[0] == "fetch" and e[2] < n else e[1] if e[0] == "look" else None
        if t is not None and 0 <= t < n:
            first[t] = min(first[t], x)
    for t in range(n - 1, -1, -1):
        first[t] = min(first[t], first[t + 1])
    changed = [0]  # namespaces changed before each event
    for e in events:
        changed.append(changed[-1] + (e[0] == "ns"))

    def render(k: int) -> tuple[int, str] | None:
        x = first[k]
        if x == len(events):
            return len(out), ""  # nothing it read depends on messages k and after
        e = events[x]
        if e[0] != "fetch" or e[1] not in ends or x + 1 >= len(events):
            return None
        after, (end, tail) = events[x + 1], ends[e[1]]
        if after[0] != "body" or after[2] != e[3] or after[1] != events[end][1]:
            return None  # not the loop's own step (a look ahead: loop.last, messages[i + 1], ...)
        if changed[end] > changed[x] or last_read > end:
            return None
        return e[3], out[tail:]

    return out, render


def assistant_spans(render: Render, messages: list, full: str, assistants: Sequence[int]) -> list[tuple[int, int]]:
    """The loss spans of the ``assistants`` messages (their indices) by the rule (see the module doc), ``full``
    the whole render and ``render(messages, add_generation_prompt)`` a render; :class:`Unlocated` for a message
    whose prefix renders are not prefixes of the whole one."""
    if not assistants:
        return []
    told = {agp: _prefix_renders(render, messages, agp) for agp in (True, False)}
    if told[False] is None or told[False][0] != full:
        told = {}
    else:
        told[False] = (full, told[False][1])  # the same text: one base
    shared = {}
    if told.get(True) is not None:  # how far the two whole renders agree
        shared = {frozenset((id(full), id(told[True][0]))): _common_prefix(full, told[True][0])}

    def common(a: str, c: str) -> int | None:
        return len(a) if a is c else shared.get(frozenset((id(a), id(c))))

    def exact(k: int, agp: bool) -> _Text:
        return _Text(render(messages[:k], agp))

    def fast(k: int, agp: bool) -> _Text | None:
        got = told[agp][1](k) if told.get(agp) is not None else None
        return None if got is None else _Text(told[agp][0], *got)

    last = assistants[-1]
    for k, agp in ((last, True), (last + 1, False)):
        guess = fast(k, agp)
        if guess is not None and str(guess) != str(exact(k, agp)):
            told = {}  # the template writes in a way the trace does not see (a buffered loop): render them all

    def prefix(k: int, agp: bool) -> _Text:
        got = fast(k, agp)
        return exact(k, agp) if got is None else got

    whole = _Text(full)
    spans = []
    for i in assistants:
        before = prefix(i, True)
        through = prefix(i + 1, False)
        if not (whole.starts_with(through, common) and through.starts_with(before, common)):
            raise Unlocated(i)
        spans.append((len(before), len(through)))
    return spans
