"""The build plan: frozen values computed from the matched input files and the options, without I/O.

The launcher matches the input files (:mod:`pipelines.launcher`, the I/O), then :func:`make_plan` turns
them and the chunking configuration into a :class:`BuildPlan`: the shards in path order, and
:meth:`BuildPlan.ledger` is the plan ``ledger.json`` written before any worker starts. Workers build
:class:`WorkUnit` values and return :class:`UnitResult` values; the ledger builder
(:mod:`pipelines.ledger`) turns those into the finished ledger. A split build (``--validation_fraction``)
writes two caches from one pass: :meth:`BuildPlan.caches` gives the plan of each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from reader.format import spec as fmt
from reader.format.splits import SPLIT_NAMES, SplitSpec

from pipelines.errors import BuildError

# Uncompressed / compressed bytes of jsonl text: only orders work units by size, never changes a byte.
COMPRESSION_RATIO_GUESS = 4
# Record limits (docs/FORMAT.md): a longer line is the bad record ``too_long``, a deeper one ``too_deep``.
# Constants, never derived from the machine: a worker's memory is bounded by max_doc_bytes (about 7
# bytes per byte of the longest document it tokenizes, docs/RUNNING.md), not by its longest input line.
DEFAULT_MAX_DOC_BYTES = 32 << 20
# Python's recursion limit: builds before this limit existed parsed with ``json``, which could not go
# deeper (minus its caller's stack), so no record they accepted is deeper; this keeps their verdicts.
MAX_JSON_DEPTH = 1000
# Config keys added after caches were built without them -> their value in a new build by default. A key
# absent from a ledger means what the cache was built with: no size limit, and MAX_JSON_DEPTH.
LATER_KEYS = {"max_doc_bytes": DEFAULT_MAX_DOC_BYTES, "max_json_depth": MAX_JSON_DEPTH, "keep_floats": True}
# (keep_floats is written only with keep_fields: a ledger without either lacks it and keeps floats)
SUPERVISED_KEYS = ("prompt_key", "completion_key", "messages_key", "chat_template")
# Range checks of the numbers an existing ledger holds (a shard's bytes, its chunks, the chunk size).
MAX_SHARD_BYTES = 1 << 50
# Input formats (pipelines.inputs.formats): a columnar file's chunks are runs of its row groups or record
# batches, planned from its metadata; the others' are byte ranges of their records.
JSONL, JSON_ARRAY = "jsonl", "json_array"
COLUMNAR = ("parquet", "arrow")


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """The chunking configuration: the ledger's ``config`` object, part of the resume fingerprint."""

    text_key: str
    append_eos: bool
    chunk_bytes: int
    row_group_tokens: int
    compression: str  # Parquet codec of the chunks ("none" for uncompressed)
    compression_level: int | None  # None for codecs without levels
    token_encoding: str
    piece_chars: int  # long-document splitting (pipelines/tokenize/tokenizer.py)
    max_piece_chars: int
    split: Mapping[str, Any] | None = None  # a split build's cache: SplitSpec.identity(name)
    # None: absent from the ledger (a cache built before the key existed, resumed as it was built)
    max_doc_bytes: int | None = None
    max_json_depth: int | None = None
    keep_fields: tuple[str, ...] = ()  # --keep_fields: per-document metadata kept in the chunks
    # kept fields may be floats (their shortest exact text); None: a cache built before, which refused them
    keep_floats: bool | None = True
    # Supervised records (pipelines/chunking/supervised.py): "text", "prompt_completion" or "chat"; the keys
    # read (None where they do not apply), and the chat template's identity ({"sha256", "source", "bos_token",
    # "eos_token"}). A text build's config has none of them.
    record_format: str = fmt.PLAIN_RECORD_FORMAT
    prompt_key: str | None = None
    completion_key: str | None = None
    messages_key: str | None = None
    chat_template: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("split", *LATER_KEYS, *SUPERVISED_KEYS):
            if out[key] is None:
                del out[key]  # a plain build's config, or an older cache's, stays exactly as it was
        if self.keep_fields:
            out["keep_fields"] = list(self.keep_fields)
        else:
            del out["keep_fields"]  # a build without it has the config (and fingerprint) it had before
            out.pop("keep_floats", None)
        if self.record_format == fmt.PLAIN_RECORD_FORMAT:
            del out["record_format"]
        return out

    def as_in(self, existing: Mapping[str, Any]) -> "ChunkConfig":
        """This configuration to resume a cache whose ledger ``config`` is ``existing``: a later key the
        ledger lacks stays absent (the cache's behaviour) if this run leaves it at its default."""
        absent = {k: None for k, default in LATER_KEYS.items() if k not in existing and getattr(self, k) == default
                  and (k != "keep_floats" or "keep_fields" in existing)}
        return dataclasses.replace(self, **absent)


@dataclasses.dataclass(frozen=True)
class MatchedFile:
    """An input file as the launcher found it: its path, size, format, (gs:// only) the object's CRC32C and,
    for a Parquet or Arrow file, its planned layout (``pipelines.inputs.columnar.ColumnarLayout``)."""

    path: str
    size: int
    crc32c: str | None = None  # base64, as Cloud Storage reports it; None for local files
    format: str = JSONL
    layout: Any = dataclasses.field(default=None, compare=False, repr=False)
    # its metadata when matched (pipelines/inputs/fingerprints.py): checked again before the ledger is finished
    fingerprint: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class InputFile:
    """A matched input file: shard ``shard`` of the cache (its position in path order)."""

    shard: int
    path: str
    size: int  # bytes of the file as stored (compressed for .gz / .zst)
    compression: str  # "none", "gzip" or "zstd"
    chunks: int | None  # from the size, or a columnar file's groups; None until a compressed file has been read
    crc32c: str | None = None  # gs:// objects: Cloud Storage's CRC32C of the stored bytes
    format: str = JSONL  # jsonl, json_array, parquet or arrow
    rows: int | None = None  # a columnar file's rows
    layout: Any = dataclasses.field(default=None, compare=False, repr=False)  # a columnar file's, as planned
    # its metadata when planned: in the plan ledger only (a finished ledger is a function of the content)
    fingerprint: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_json(self, version: int = fmt.FORMAT_VERSION) -> dict[str, Any]:
        """The ledger's ``inputs`` entry (version 2's has no ``format`` and ``rows``)."""
        out = {"shard": self.shard, "path": self.path, "size": self.size, "compression": self.compression,
               "chunks": self.chunks, "crc32c": self.crc32c}
        if version >= 3:
            out["format"] = self.format
            if self.rows is not None:
                out["rows"] = self.rows
        return out


@dataclasses.dataclass(frozen=True)
class WorkUnit:
    """What one worker call builds.

    Chunk ``index`` of an uncompressed JSON Lines shard (the lines starting in ``[lo, hi)``) or of a columnar
    shard (``columnar``: its groups; ``[lo, hi)`` its rows), or, with ``index`` None, every chunk of a
    compressed shard or a JSON array (streamed once from the start, cut by uncompressed offset).
    """

    shard: int
    path: str
    compression: str
    size: int  # the input file's size when planned: a file that changes is an error
    index: int | None
    lo: int
    hi: int | None
    estimate: int  # uncompressed bytes (guessed for compressed shards): larger units start first
    trusted: bool = False  # the input's content is known unchanged (same CRC32C): skipped chunks need no re-read
    format: str = JSONL
    columnar: Any = None  # pipelines.inputs.columnar.ColumnarChunk of a columnar chunk

    @property
    def streamed(self) -> bool:
        return self.index is None


@dataclasses.dataclass(frozen=True)
class UnitResult:
    """What a work unit leaves in one cache: its chunks' entries (each sidecar without ``SIDECAR_ONLY_KEYS``,
    plus ``sidecar_checksum``: what the table needs, not the row-group index) and, for a compressed shard, its
    ``_DONE.json``. A split build's unit leaves one result per split."""

    shard: int
    entries: tuple[dict[str, Any], ...]
    done: dict[str, int] | None  # {"chunks": n, "uncompressed_bytes": U} of a streamed shard
    split: str | None = None  # the cache ("train" / "validation") of a split build


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Everything the job needs to know before it starts; equal plans build byte-identical caches."""

    tokenizer: dict[str, Any]  # the ledger's tokenizer identity (TokenizerSpec.identity())
    config: ChunkConfig
    inputs: tuple[InputFile, ...]
    trusted: frozenset[int] = frozenset()  # shards whose stored bytes match the existing ledger's (CRC32C)
    split: SplitSpec | None = None  # a split build: two caches, train and validation
    resumes: int | None = None  # the format version of the cache a rerun continues (None: a new cache)

    def caches(self) -> tuple[tuple[str | None, "BuildPlan"], ...]:
        """``(name, plan)`` of each cache the build writes: ``((None, self),)`` for a plain build, else train
        and validation, whose plans differ only in ``config.split`` (so each ledger names its split)."""
        if self.split is None:
            return ((None, self),)
        return tuple((name, dataclasses.replace(self, split=None, config=dataclasses.replace(
            self.config, split=self.split.identity(name)))) for name in SPLIT_NAMES)

    @property
    def format_version(self) -> int:
        """The cache's format version (:func:`reader.format.spec.written_version`): the newest for a new
        cache, the cache's own for a rerun of an older one."""
        return fmt.written_version(self.resumes)

    def ledger(self) -> dict[str, Any]:
        """The plan ``ledger.json``: ``finished`` false, no chunks yet; each input with its ``fingerprint`` when
        planned (see docs/FORMAT.md)."""
        version = self.format_version
        return {
            "format": fmt.FORMAT_NAME,
            "format_version": version,
            "finished": False,
            "tokenizer": dict(self.tokenizer),
            "config": self.config.to_json(),
            "inputs": [{**inp.to_json(version), **({"fingerprint": dict(inp.fingerprint)} if inp.fingerprint else {})}
                       for inp in self.inputs],
            "chunks": [],
            "totals": {},
            "bad_records": {},
        }


def make_plan(tokenizer: Mapping[str, Any], config: ChunkConfig, files: Sequence[MatchedFile],
              split: SplitSpec | None = None) -> BuildPlan:
    """The plan for ``files``: sorted by path, the shards ``0..K-1``.

    Args:
      tokenizer: the tokenizer identity recorded in the ledger.
      config: the chunking configuration.
      files: every matched input file.
      split: the train/validation split, or None for one cache.
    """
    inputs = []
    for shard, f in enumerate(sorted(files, key=lambda f: f.path)):
        compression, rows = fmt.compression_of(f.path), None
        if f.format in COLUMNAR:
            if f.layout is None:
                raise ValueError(f"internal: {f.path} was matched without its layout")
            compression, chunks, rows = "none", len(f.layout.chunks), f.layout.rows
        else:
            chunks = fmt.num_chunks(f.size, config.chunk_bytes) if compression == "none" else None
        inputs.append(InputFile(shard=shard, path=f.path, size=f.size, compression=compression, chunks=chunks,
                                crc32c=f.crc32c, format=f.format, rows=rows, layout=f.layout,
                                fingerprint=f.fingerprint))
    return BuildPlan(tokenizer=dict(tokenizer), config=config, inputs=tuple(inputs), split=split)


class UnitList:
    """A plan's work units, largest (estimated) first, made when asked for (:meth:`unit`): one per chunk of an
    uncompressed JSON Lines or a columnar shard, one per compressed shard or JSON array; three arrays for a
    million units. The order changes no output byte: largest-first balances static partitioning and starts
    compressed shards (the longest units, whose counts gate what a reader can follow) early. It is a function
    of the ledger alone (a columnar chunk counts as ``chunk_bytes``), the same on every worker.

    ``layout_of``: a columnar input's layout (default the plan's; a worker, whose plan comes from the ledger,
    plans it again from the file's metadata).
    """

    def __init__(self, plan: "BuildPlan", layout_of: Callable[["InputFile"], Any] | None = None):
        self.plan = plan
        self.layout_of = layout_of or _planned_layout
        cb = plan.config.chunk_bytes
        shard, index, estimate = [], [], []
        for inp in plan.inputs:
            if inp.format in COLUMNAR or (inp.compression == "none" and inp.format == JSONL):
                k = np.arange(inp.chunks, dtype=np.int64)
                shard.append(np.full(inp.chunks, inp.shard, np.int64))
                index.append(k)
                if inp.format in COLUMNAR:  # chunks of about chunk_bytes tie, and go in order (the order readers follow)
                    estimate.append(np.full(inp.chunks, cb, np.int64))
                else:
                    estimate.append(np.minimum((k + 1) * cb, inp.size) - k * cb)
            else:
                ratio = 1 if inp.compression == "none" else COMPRESSION_RATIO_GUESS
                shard.append(np.asarray([inp.shard], np.int64))
                index.append(np.asarray([-1], np.int64))
                estimate.append(np.asarray([inp.size * ratio], np.int64))
        cat = (lambda a: np.concatenate(a) if a else np.zeros(0, np.int64))
        shard, index, estimate = cat(shard), cat(index), cat(estimate)
        order = np.lexsort((np.maximum(index, 0), shard, -estimate))
        self.shard, self.index, self.estimate = shard[order], index[order], estimate[order]

    def __len__(self) -> int:
        return int(self.shard.size)

    def unit(self, i: int) -> WorkUnit:
        """Unit ``i`` of the order."""
        inp = self.plan.inputs[int(self.shard[i])]
        k, cb = int(self.index[i]), self.plan.config.chunk_bytes
        trusted = inp.shard in self.plan.trusted
        if k < 0:
            return WorkUnit(shard=inp.shard, path=inp.path, compression=inp.compression, size=inp.size, index=None,
                            lo=0, hi=None, estimate=int(self.estimate[i]), trusted=trusted, format=inp.format)
        if inp.format in COLUMNAR:
            c = self.layout_of(inp).chunk(k)
            return WorkUnit(shard=inp.shard, path=inp.path, compression="none", size=inp.size, index=k,
                            lo=c.row_range[0], hi=c.row_range[1], estimate=int(self.estimate[i]), trusted=trusted,
                            format=inp.format, columnar=c)
        lo, hi = k * cb, min((k + 1) * cb, inp.size)
        return WorkUnit(shard=inp.shard, path=inp.path, compression="none", size=inp.size, index=k, lo=lo, hi=hi,
                        estimate=hi - lo, trusted=trusted)

def _planned_layout(inp: "InputFile") -> Any:
    if inp.layout is None:
        raise ValueError(f"internal: {inp.path} has no planned layout")
    return inp.layout


def _differences(section: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [f"{section}.{k}: {old.get(k)!r} in the cache, {new.get(k)!r} now"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _listed(paths: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def reconcile(plan: BuildPlan, existing: Mapping[str, Any], output: str,
              shards_with_chunks: frozenset[int] | set[int] = frozenset(),
              roots: Sequence[str] = ()) -> BuildPlan:
    """The plan to run against the ``existing`` ledger in ``output``, or a BuildError saying why not.

    The same tokenizer and chunking configuration (the fingerprint) and the same input paths are required;
    operational options such as the runner or ``--max_bad_fraction`` may differ. An input whose size
    changed is accepted only while none of its chunks exists in an unfinished cache (its chunks would not
    line up with its lines any more); an input whose content changed at the same size is found chunk by
    chunk by the workers (input checksums) and those chunks are rebuilt. A finished cache is never
    rebuilt from other inputs. Inputs whose Cloud Storage CRC32C equals the ledger's are marked trusted.

    Args:
      plan: the plan of this command.
      existing: the ledger found in ``output``.
      output: the cache root (for messages).
      shards_with_chunks: shards of ``existing`` that have chunk or dead-letter files in ``output``.
      roots: every cache of the build (default ``output`` alone), whose files of a resized shard the
        message says to delete (a split build's train and validation).
    """
    check_ledger(existing, fmt.join(output, fmt.LEDGER_NAME))
    plan = dataclasses.replace(plan, config=plan.config.as_in(existing["config"]))
    config = plan.config.to_json()
    if fmt.config_fingerprint(plan.tokenizer, config) != fmt.config_fingerprint(existing["tokenizer"],
                                                                                existing["config"]):
        what = _differences("tokenizer", existing["tokenizer"], plan.tokenizer)
        what += _differences("config", existing["config"], config)
        raise BuildError(
            f"{output} already holds a cache built with a different tokenizer or chunking configuration "
            f"({'; '.join(what)}). Refusing to mix them: rerun with the cache's options to resume, or use "
            f"another --output, or delete {output} to rebuild.")
    old_paths = [i["path"] for i in existing["inputs"]]
    new_paths = [inp.path for inp in plan.inputs]
    if old_paths != new_paths:
        gone = [p for p in old_paths if p not in set(new_paths)]
        added = [p for p in new_paths if p not in set(old_paths)]
        what = ([f"no longer matched: {_listed(gone)}"] if gone else []) + \
               ([f"newly matched: {_listed(added)}"] if added else [])
        raise BuildError(
            f"{output} already holds a cache built from other input files ({'; '.join(what)}). Rerun with the "
            f"same --input files to resume, or use another --output, or delete {output} to rebuild.")
    finished = bool(existing.get("finished"))
    trusted = set()
    for old, inp in zip(existing["inputs"], plan.inputs):
        if old.get("format", JSONL) != inp.format:
            raise BuildError(
                f"input file {inp.path} was read as {old.get('format', JSONL)} when the cache in {output} was "
                f"built, and is {inp.format} now. Restore the file, or use another --output, or delete {output} "
                "to rebuild.")
        change = shape_change(old, inp)
        if change is not None:
            if finished:
                raise BuildError(
                    f"input file {inp.path} changed since the cache in {output} was finished ({change}). A "
                    "finished cache is never rebuilt from other inputs (readers may be using it): build into "
                    "another --output, or restore the file.")
            if inp.shard in shards_with_chunks:
                shard = fmt.shard_dir(inp.shard)
                dirs = [d for root in (roots or [output])
                        for d in (fmt.join(root, shard), f"{fmt.join(root, fmt.BAD_DIR)}/shard-{inp.shard:05d}")]
                what = "changed size" if old["size"] != inp.size else "changed its row groups"
                raise BuildError(
                    f"input file {inp.path} (shard {inp.shard}) {what} since this build started ({change}), so the "
                    f"chunks already built from it in {fmt.join(output, shard)}/ no longer line up with its "
                    f"records. Restore the file and rerun, or rebuild this shard from its new content: delete "
                    f"{', '.join(dirs[:-1])} and {dirs[-1]}, then rerun the same command (the other shards are kept).")
        old_crc = old.get("crc32c")
        if old_crc is not None and inp.crc32c is not None:
            if old_crc == inp.crc32c and old["size"] == inp.size:
                trusted.add(inp.shard)
            elif finished:
                raise BuildError(
                    f"input file {inp.path} changed since the cache in {output} was finished (CRC32C {old_crc} "
                    f"then, {inp.crc32c} now). A finished cache is never rebuilt from other inputs: build into "
                    "another --output, or restore the object.")
    return dataclasses.replace(plan, trusted=frozenset(trusted))


def shape_change(old: Mapping[str, Any], inp: InputFile) -> str | None:
    """How input ``inp`` changed since the ledger entry ``old`` was planned, such that its chunks no longer
    line up: its size, or a columnar file's rows or chunks (its groups). None if it did not."""
    if old.get("size") != inp.size:
        return f"size {old.get('size')} bytes then, {inp.size} now"
    if inp.format in COLUMNAR and (old.get("rows"), old.get("chunks")) != (inp.rows, inp.chunks):
        return f"{old.get('rows')} rows in {old.get('chunks')} chunks then, {inp.rows} in {inp.chunks} now"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_ledger(ledger: Mapping[str, Any], where: str) -> None:
    """Refuse (BuildError, one line) an existing ledger whose numbers the builder would use out of range.

    A hand-edited or damaged ledger must not become a loop over 2**40 chunks or a huge allocation:
    each input's size, shard and chunk count, the chunk size, and a finished ledger's chunk entries.
    """
    def bad(what: str, value: Any, why: str = "out of range") -> BuildError:
        root = where.rsplit("/", 1)[0]
        return BuildError(f"{where}: {what} is {_shown(value)}, {why}: the ledger is damaged. Restore it, or delete "
                          f"{root} to rebuild the cache")

    def integer(value: Any, lo: int, hi: int) -> bool:
        return type(value) is int and lo <= value <= hi

    config, inputs = ledger.get("config"), ledger.get("inputs")
    if not isinstance(config, dict) or not isinstance(ledger.get("tokenizer"), dict):
        raise bad("config or tokenizer", config, "not an object")
    cb = config.get("chunk_bytes")
    if not integer(cb, 1, MAX_SHARD_BYTES):
        raise bad("config.chunk_bytes", cb)
    if not isinstance(inputs, list):
        raise bad("inputs", inputs, "not a list")
    most = fmt.num_chunks(MAX_SHARD_BYTES, cb)
    counts = []
    for i, inp in enumerate(inputs):
        if not isinstance(inp, dict) or not isinstance(inp.get("path"), str) or inp.get("shard") != i:
            raise bad(f"inputs[{i}]", inp, f"not input {i} (a path and shard {i})")
        size, chunks = inp.get("size"), inp.get("chunks")
        if not integer(size, 0, MAX_SHARD_BYTES):
            raise bad(f"inputs[{i}].size", size)
        # else the uncompressed size is not known here (a columnar file's chunks follow its decoded groups)
        stored = inp.get("compression", "none") == "none" and inp.get("format", JSONL) not in COLUMNAR
        if chunks is not None and not integer(chunks, 0, max(1, fmt.num_chunks(size, cb)) if stored else most):
            raise bad(f"inputs[{i}].chunks", chunks)
        counts.append(most if chunks is None else chunks)
    entries = ledger.get("chunks", [])
    if not isinstance(entries, list):
        raise bad("chunks", entries, "not a list")
    for j, c in enumerate(entries):
        shard = c.get("shard") if isinstance(c, dict) else None
        if not integer(shard, 0, len(inputs) - 1):
            raise bad(f"chunks[{j}].shard", shard)
        index = c.get("index_in_shard")
        if not integer(index, 0, counts[shard] - 1):
            raise bad(f"chunks[{j}].index_in_shard", index)
