"""The mixture file: a JSON file naming component caches, their weights and a weight schedule.

::

    {"mixture": 1,
     "components": [{"name": "web", "path": "gs://b/web", "weight": 0.7},
                    {"name": "code", "path": "../code", "weight": 0.3}],
     "schedule": [{"start_batch": 90000, "weights": {"web": 0.4, "code": 0.6}}],
     "seed": 0, "block": 1024}

Relative component paths are relative to the file's directory (local or any fsspec URL). Weights are
normalised per segment (they need not sum to 1); a schedule entry's ``weights`` apply from global batch
``start_batch`` on, and a component it does not name gets weight 0 there. :func:`load_mixture` parses and
checks the file (every error names the file and the key); it does not open the caches
(:mod:`reader.mixture.mixture` does). docs/MIXTURES.md has the semantics.
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
from fractions import Fraction
from typing import Any, Mapping

import fsspec

from reader.format.checks import load_json, short
from reader.mixture.quotas import DEFAULT_BLOCK, QUANTUM_BITS, MixtureQuotas, quantise
from reader.storage import files
from reader.storage.view_syntax import ViewError, parse_view
from reader.storage.whatis import not_a_cache

FORMAT_VERSION = 1
TOP_KEYS = ("mixture", "components", "schedule", "seed", "block")
COMPONENT_KEYS = ("name", "path", "weight", "max_passes", "view")
MAX_PASSES = 1 << 40  # passes over one component a run can be limited to, at most
SCHEDULE_KEYS = ("start_batch", "weights")
MAX_BLOCK = 1 << 20
MAX_WEIGHT = 1 << 53  # weights are relative: no mixture needs a larger one, and a float holds these exactly
MAX_MIXTURE_FILE_BYTES = 256 << 20  # 100,000 components take 5.7 MB
MAX_START_BATCH = 1 << 40  # start_batch * batch_size must stay far inside int64 (global example numbers)


class MixtureError(ValueError):
    """A mixture file that cannot be used; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Component:
    """One component: its name, its cache (``path`` as written, ``url`` resolved), base weight and the
    passes over it a run may draw (``max_passes``, None: any) and the view of its cache it reads (``view``: the
    canonical text of ``ReadOptions.view``'s syntax; None: the reader's ``view``)."""

    name: str
    path: str
    url: str
    weight: Fraction
    max_passes: Fraction | None = None
    view: str | None = None


@dataclasses.dataclass(frozen=True)
class MixtureSpec:
    """A parsed, checked mixture file.

    Attributes:
      source: the file as given (path or URL).
      components: in file order (their index is the ``components`` value of a batch row).
      segments: ``(start_batch, weights)`` per schedule segment, the first at batch 0 with the
        components' own weights; ``weights`` are exact fractions, one per component, not normalised.
      seed: keys the arrangement inside blocks.
      block: lane positions per block (``b``); a nonzero weight must be at least ``1 / block``.
    """

    source: str
    components: tuple[Component, ...]
    segments: tuple[tuple[int, tuple[Fraction, ...]], ...]
    seed: int
    block: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)

    def normalised(self, s: int) -> tuple[float, ...]:
        """Segment ``s``'s weights normalised to sum 1 (floats, for display)."""
        ws = self.segments[s][1]
        total = sum(ws, Fraction(0))
        return tuple(float(w / total) for w in ws)

    def quotas(self, lanes: int, batch_size: int) -> MixtureQuotas:
        """The :class:`reader.mixture.quotas.MixtureQuotas` for ``R* = lanes`` and global batch size ``batch_size``."""
        last = self.segments[-1][0]
        if last * int(batch_size) > MAX_START_BATCH << 20:
            raise MixtureError(f"{self.source}: schedule start_batch {last} x batch_size {batch_size} is beyond the "
                               f"examples a run can number ({MAX_START_BATCH << 20}); lower the start_batch")
        return MixtureQuotas(lanes=int(lanes), block=self.block, seed=self.seed,
                       starts=tuple(start * int(batch_size) for start, _ in self.segments),
                       prefixes=tuple(quantise(ws) for _, ws in self.segments))


def is_mixture_path(source: Any) -> bool:
    """True for what names a mixture file (a ``.json`` path or URL); caches are directories."""
    return isinstance(source, (str, os.PathLike)) and os.fspath(source).lower().endswith(".json")


def _resolve(base: str, path: str) -> str:
    """``path`` relative to the directory of ``base`` (a local path or fsspec URL), unless absolute."""
    if "://" in path or path.startswith("/") or (os.name == "nt" and os.path.isabs(path)):
        return path
    if "://" in base:
        proto, rest = base.split("://", 1)
        return f"{proto}://{posixpath.normpath(posixpath.join(posixpath.dirname(rest), path))}"
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(base)), path))


def _weight(where: str, key: str, v: Any) -> Fraction:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise MixtureError(f"{where}: {key} must be a finite number, got {short(v)}")
    if v < 0:
        raise MixtureError(f"{where}: {key} is negative ({short(v)}); weights must be >= 0")
    if v > MAX_WEIGHT:
        raise MixtureError(f"{where}: {key} is {short(v)}, above the largest weight 2**53; weights are relative: "
                           "scale them all down")
    return Fraction(v)  # exact: a float's own binary value



def _int(where: str, key: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > hi:
        raise MixtureError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {short(v)}")
    return v


def _keys(where: str, key: str, obj: Any, allowed: tuple[str, ...], required: tuple[str, ...]) -> Mapping:
    if not isinstance(obj, dict):
        raise MixtureError(f"{where}: {key} must be an object {{...}}, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise MixtureError(f"{where}: unknown key {key + '.' if key else ''}{unknown[0]!r}; "
                           f"allowed: {', '.join(allowed)}")
    for k in required:
        if k not in obj:
            raise MixtureError(f"{where}: {key + ': ' if key else ''}missing required key {k!r}")
    return obj


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def parse_mixture(text: str | bytes, source: str) -> MixtureSpec:
    """Parse and check the text of mixture file ``source`` (see the module docstring)."""
    where = source
    try:
        raw = load_json(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise MixtureError(f"{where}: not valid JSON ({e})") from e
    if isinstance(raw, dict) and "mixture" not in raw and raw.get("format") == "chunkledger":
        raise MixtureError(f"{where}: this is a cache's ledger, not a mixture file; pass the cache directory "
                           "instead, or a mixture file ({\"mixture\": 1, \"components\": [...]})")
    top = _keys(where, "", raw, TOP_KEYS, ("mixture", "components"))
    if top["mixture"] != FORMAT_VERSION or isinstance(top["mixture"], bool):
        raise MixtureError(f"{where}: \"mixture\" must be {FORMAT_VERSION} (the file format version), "
                           f"got {short(top['mixture'])}")
    comps = top["components"]
    if not isinstance(comps, list) or not comps:
        raise MixtureError(f"{where}: \"components\" must be a non-empty list of {{name, path, weight}}")
    components: list[Component] = []
    seen: dict[str, int] = {}
    resolved: dict[str, str] = {}  # path as written -> URL (many components may name one cache)
    for i, c in enumerate(comps):
        key = f"components[{i}]"
        _keys(where, key, c, COMPONENT_KEYS, ("name", "path", "weight"))
        name, path = c["name"], c["path"]
        if not isinstance(name, str) or not name:
            raise MixtureError(f"{where}: {key}.name must be a non-empty string, got {name!r}")
        if name in seen:
            raise MixtureError(f"{where}: {key}.name {name!r} is used twice (also components[{seen[name]}]); "
                               "names must be unique")
        seen[name] = i
        if not isinstance(path, str) or not path:
            raise MixtureError(f"{where}: {key}.path must be a non-empty string, got {path!r}")
        if path not in resolved:
            resolved[path] = _resolve(source, path)
        limit = c.get("max_passes")
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, (int, float)) \
                    or not (math.isfinite(limit) and 0 < limit <= MAX_PASSES):
                raise MixtureError(f"{where}: {key}.max_passes must be a number in (0, 2**40] (the passes over "
                                   f"this component a run may draw), got {short(limit)}")
            limit = Fraction(limit)
        try:
            view = parse_view(c.get("view"))
        except ViewError as e:
            raise MixtureError(f"{where}: {key}.view: {e}") from None
        components.append(Component(name, path, resolved[path], _weight(where, f"{key}.weight", c["weight"]),
                                    limit, None if view is None else view.text))
    names = [c.name for c in components]
    segments = [(0, tuple(c.weight for c in components))]
    sched = top.get("schedule", [])
    if not isinstance(sched, list):
        raise MixtureError(f"{where}: \"schedule\" must be a list of {{start_batch, weights}}")
    for j, e in enumerate(sched):
        key = f"schedule[{j}]"
        _keys(where, key, e, SCHEDULE_KEYS, SCHEDULE_KEYS)
        start = _int(where, f"{key}.start_batch", e["start_batch"], 1, MAX_START_BATCH)
        if start <= segments[-1][0]:
            raise MixtureError(f"{where}: {key}.start_batch {start} must be greater than the previous "
                               f"segment's start ({segments[-1][0]}); the schedule must increase in "
                               "start_batch (the top-level weights apply from batch 0)")
        ws = e["weights"]
        if not isinstance(ws, dict):
            raise MixtureError(f"{where}: {key}.weights must be an object {{component name: weight}}")
        for n in ws:
            if n not in seen:
                raise MixtureError(f"{where}: {key}.weights names unknown component {n!r}; components: "
                                   f"{', '.join(names)}")
        segments.append((start, tuple(_weight(where, f"{key}.weights.{n}", ws[n]) if n in ws else Fraction(0)
                                      for n in names)))
    seed = _int(where, "seed", top.get("seed", 0), 0, (1 << 64) - 1)
    block = _int(where, "block", top.get("block", DEFAULT_BLOCK), 1, MAX_BLOCK)
    spec = MixtureSpec(source, tuple(components), tuple(segments), seed, block)
    for s, (start, ws) in enumerate(segments):
        key = "components[*].weight" if s == 0 else f"schedule[{s - 1}].weights"
        if sum(ws) <= 0:
            raise MixtureError(f"{where}: {key}: every weight is 0; at least one component needs a positive weight")
    plan = spec.quotas(1, 1)
    for s, (q, (start, ws)) in enumerate(zip(plan.prefixes, segments)):
        for c, w in enumerate(ws):
            if w and q[c + 1] == q[c]:  # quantised to nothing: it would silently never be drawn
                key = f"components[{c}].weight" if s == 0 else f"schedule[{s - 1}].weights.{names[c]}"
                raise MixtureError(
                    f"{where}: {key}: component {names[c]!r} has normalised weight {spec.normalised(s)[c]:.3g}, too "
                    f"small to be represented: weights are quantised to multiples of 2**-{QUANTUM_BITS} "
                    f"({2.0 ** -QUANTUM_BITS:.3g}) of their segment's total, and a nonzero weight must be at least "
                    f"1/block ({1 / block:.3g} with block {block}; {1 / MAX_BLOCK:.3g} with the largest block, "
                    f"{MAX_BLOCK}). Raise it, or set it to 0")
    bad = plan.min_weight_error()
    if bad is not None:
        s, c = bad
        key = f"components[{c}].weight" if s == 0 else f"schedule[{s - 1}].weights.{names[c]}"
        raise MixtureError(
            f"{where}: {key}: component {names[c]!r} has normalised weight {spec.normalised(s)[c]:.3g}, below the "
            f"block minimum 1/{block} = {1 / block:.3g} (each block of {block} positions per stream must hold at "
            f"least one of its examples). Set a larger \"block\" (e.g. {_pow2_at_least(spec.normalised(s)[c])}), "
            "raise the weight, or set it to 0")
    return spec


def _pow2_at_least(w: float) -> int:
    b = 1
    while b * w < 1:
        b *= 2
    return min(b, MAX_BLOCK)


def load_mixture(source: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> MixtureSpec:
    """Read and check the mixture file ``source`` (local path or fsspec URL)."""
    source = os.fspath(source)
    fs, path = fsspec.core.url_to_fs(source, **dict(storage_options or {}))
    try:
        text = files.FsspecStorage(fs).read(path, limit=MAX_MIXTURE_FILE_BYTES)
    except FileNotFoundError:
        raise MixtureError(f"{source}: no such mixture file") from None
    except files.UnsafeFile as e:  # a FIFO, a device, a file larger than any mixture: refused unread
        raise MixtureError(f"{source}: {e.what}") from None
    try:
        raw = load_json(text)
    except ValueError:
        raw = None
    if isinstance(raw, dict) and "mixture" not in raw:  # a ledger or sidecar passed as a cache: say what it is
        raise not_a_cache(fs, path, source)
    return parse_mixture(text, source)
