"""Checking chunk files against the ledger: :class:`ChunkError`, whole-file checks, ``validate``.

Every check of a chunk (the store's per-row-group checks, :func:`parse_chunk` on a whole file, and
:func:`validate_chunk` behind ``python -m reader validate``) reports a mismatch as a :class:`ChunkError`
that names the file and says how to repair it.

``validate`` names the culprit, not just a mismatch. Each chunk has three witnesses: its entry in the
finished ledger, its sidecar (whose sha256 the ledger records) and the Parquet file (whose size and
sha256 the ledger and the sidecar record; the sidecar also records each row group's and the footer's
sha256). When two agree and the third does not, the third is the damaged one: a file that matches its
sidecar but not the ledger means the ledger entry was changed; a sidecar that matches neither is the
damaged sidecar; a file that matches neither is the damaged file, and the sidecar's row-group index
says where (which row group, the footer, or truncated at N of M bytes).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from reader.format import spec as fmt
from reader.format import table as chunk_table
from reader.format.sidecar import (Disagreement, Layout, arrow_message, dead_letters_problem, entry_fields,
                                   file_mismatch, loss_tokens, sidecar_bytes, size_mismatch)
from reader.storage import remote
from reader.storage.cache import Cache
from reader.storage.pages import int_values, loss_flags

class ChunkError(fmt.DamagedCache):
    """A chunk file is missing, truncated, corrupted, or does not match its ledger entry."""


def chunk_error(cache: Cache, rel: str, what: str) -> ChunkError:
    return ChunkError(
        f"{cache.display(rel)}: {what}. The file does not match the ledger; no tokens were returned from "
        "it. Rerun the build command that made this cache (it rewrites missing chunks; delete a damaged "
        "chunk and its .json sidecar first), or run `python -m reader validate` to list every problem."
    )


def parse_chunk(cache: Cache, index: int, data: bytes, entry: dict[str, Any] | None = None) -> WholeChunk:
    """Verify ``data`` (the bytes of global chunk ``index``) against the ledger and read its layout.

    Args:
      entry: the record to check against (``bytes``, ``checksum``, ``docs``, ``tokens``) instead of the
        ledger's (``validate``, when the ledger entry is the damaged witness).
    """
    t = cache.table
    rel = t.paths[index]
    want = {"bytes": int(t.nbytes[index]), "checksum": t.checksums[index], "docs": int(t.docs[index]),
            "tokens": int(t.tokens[index]), **(entry or {})}
    wrong = file_mismatch(data, int(want["bytes"]), want["checksum"])
    if wrong:
        raise chunk_error(cache, rel, wrong)
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        kv = pf.metadata.metadata or {}
        rg_tokens = fmt.load_json(kv[fmt.ROW_GROUP_TOKENS_KEY])
        lengths = int_values(pf.read(columns=[fmt.LENGTH_COLUMN], use_threads=False).column(0)).astype(np.int64)
        rg_rows = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
    except KeyError:
        raise chunk_error(cache, rel, f"no {fmt.ROW_GROUP_TOKENS_KEY.decode()} key in the Parquet metadata") from None
    except Exception as e:  # pyarrow raises several types for damaged files
        raise chunk_error(cache, rel, f"not a readable Parquet chunk ({arrow_message(e)})") from e
    if len(rg_tokens) != len(rg_rows):
        raise chunk_error(cache, rel, f"{len(rg_rows)} row groups but {len(rg_tokens)} row-group token counts")
    if lengths.size != int(want["docs"]) or int(lengths.sum()) != int(want["tokens"]):
        raise chunk_error(cache, rel, f"{lengths.size} documents / {int(lengths.sum())} tokens, the ledger says "
                          f"{want['docs']} / {want['tokens']}")
    rg_doc_starts = np.concatenate([[0], np.cumsum(rg_rows, dtype=np.int64)])
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    rg_token_starts = np.concatenate([[0], np.cumsum(np.asarray(rg_tokens, dtype=np.int64))])
    if not np.array_equal(doc_starts[rg_doc_starts], rg_token_starts):
        raise chunk_error(cache, rel, "row-group token counts disagree with the num_tokens column")
    return WholeChunk(index, rel, data, rg_token_starts, rg_doc_starts, lengths, doc_starts, pf.metadata)


@dataclasses.dataclass(frozen=True)
class WholeChunk:
    """A chunk file fetched whole and verified against the ledger (``validate`` and old sidecars)."""

    index: int
    path: str
    data: bytes
    rg_token_starts: np.ndarray
    rg_doc_starts: np.ndarray
    doc_lengths: np.ndarray
    doc_starts: np.ndarray
    file_meta: Any = None


def chunk_doc_lengths(cache: Cache, index: int) -> np.ndarray:
    """The document lengths of chunk ``index`` (its ``num_tokens`` column alone, as ``inspect`` needs),
    checked against the ledger's document and token counts; a damaged file raises :class:`ChunkError`."""
    t = cache.table
    rel = t.paths[index]
    if int(t.docs[index]) == 0:
        return np.zeros(0, np.int64)
    try:
        # ParquetFile.read, not pq.read_table: read_table's dataset machinery, called from several threads (as
        # inspect does), made the process abort at exit now and then ("terminate called without an active exception")
        with cache.storage.open(cache.path(rel)) as f:
            col = pq.ParquetFile(f).read(columns=[fmt.LENGTH_COLUMN]).column(0)
        lengths = int_values(col).astype(np.int64)
    except FileNotFoundError:
        raise chunk_error(cache, rel, "missing (listed in the ledger)") from None
    except Exception as e:  # pyarrow raises several types for damaged files
        if remote.is_storage_error(e):
            raise remote.storage_error(cache.display(rel), e, anonymous=cache.anonymous) from e
        try:  # the usual cause, said precisely (the size costs one more request, on this error path only)
            wrong = size_mismatch(cache.storage.size(cache.path(rel)), int(t.nbytes[index]))
        except Exception:  # noqa: BLE001 - fall back to pyarrow's words
            wrong = None
        raise chunk_error(cache, rel, wrong or f"not a readable Parquet chunk ({arrow_message(e)})") from e
    if lengths.size != int(t.docs[index]) or int(lengths.sum()) != int(t.tokens[index]):
        raise chunk_error(cache, rel, f"its {fmt.LENGTH_COLUMN} column holds {lengths.size} documents / "
                          f"{int(lengths.sum())} tokens, the ledger says {int(t.docs[index])} / {int(t.tokens[index])}")
    return lengths


# --------------------------------------------------------------------------------------------------
# python -m reader validate


def validate_ledger(cache: Cache) -> list[str]:
    """Problems of a finished ledger as a whole: totals and offsets that disagree with its chunks (every table block)."""
    if not cache.complete:
        return []
    t = cache.table
    where = cache.display(fmt.LEDGER_NAME)
    problems = []
    totals = cache.ledger.totals
    sums = [("docs", int(t.docs.sum())), ("tokens", int(t.tokens.sum())), ("chunks", len(t))]
    if cache.ledger.masked:
        if t.loss_tokens is None:
            problems.append(f"{where}: a cache with loss masks whose chunk entries do not all have loss_tokens (the "
                            "ledger was changed after the build)")
        else:
            sums.append(("loss_tokens", int(t.loss_tokens.sum())))
    for key, want in sums:
        if key in totals and int(totals[key]) != want:
            problems.append(f"{where}: totals.{key} = {totals[key]}, the chunk entries sum to {want} (the ledger "
                            "was changed after the build)")
    if chunk_table.table_of(t) is not None:  # offsets derived; every block must be the one the ledger records
        return problems + chunk_table.table_of(t).problems()
    doc_off, tok_off = t.doc_offsets, t.token_offsets
    for i, e in enumerate(cache.ledger.raw["chunks"]):
        if e.get("doc_offset") != int(doc_off[i]) or e.get("token_offset") != int(tok_off[i]):
            problems.append(f"{where}: chunk {i} ({e['path']}) has doc_offset/token_offset {e.get('doc_offset')}/"
                            f"{e.get('token_offset')}, the entries before it sum to {int(doc_off[i])}/{int(tok_off[i])}")
            break
    return problems


_CHUNK_FILE = re.compile(r"chunk-(\d{6,})\.(parquet|json)")
_SHARD_DIR = re.compile(r"shard-(\d{5,})")


def _names(cache: Cache, rel: str) -> list[str]:
    return [e.path.rstrip("/").rsplit("/", 1)[-1] for e in cache.storage.list(cache.path(rel))]


def validate_shards(cache: Cache, shards: Sequence[int] | None = None) -> list[str]:
    """Problems of a finished ledger against the files of its shards: a ``_DONE.json`` (compressed shards)
    that announces another chunk count or size than the ledger, a shard directory holding a chunk or
    sidecar past the ledger's count (the ledger lists fewer chunks than were written: a plan marked
    finished by hand, or an edited ledger), a shard directory the ledger has no input for. One listing per
    listed shard directory (all, or ``shards``): only ``validate`` does this (opening a cache reads no directory)."""
    if not cache.complete:
        return []
    led, problems = cache.ledger, []
    n_inputs = len(led.inputs)
    per_shard = np.bincount(cache.table.shard, minlength=n_inputs) if len(cache.table) else np.zeros(n_inputs, int)
    fix = "the ledger does not list every chunk that was written (a build's plan marked finished, or an edited " \
          "ledger): rerun the build command that made this cache"
    for name in _names(cache, fmt.CHUNKS_DIR):
        m = _SHARD_DIR.fullmatch(name)
        if m and int(m.group(1)) >= n_inputs:
            where = cache.display(fmt.CHUNKS_DIR + "/" + name)
            problems.append(f"{where}: a directory of shard {int(m.group(1))}, but {fmt.LEDGER_NAME} has {n_inputs} "
                            f"input shards; {fix}")
    for i in range(n_inputs) if shards is None else shards:
        inp = led.raw["inputs"][i]
        n, rel = int(per_shard[i]), fmt.shard_dir(i)
        names = _names(cache, rel)
        past = sorted({int(m.group(1)) for m in map(_CHUNK_FILE.fullmatch, names) if m and int(m.group(1)) >= n})
        if past:
            problems.append(f"{cache.display(rel)}: holds chunk {past[0]}" + (f" (and {len(past) - 1} more)" if
                            len(past) > 1 else "") + f", {fmt.LEDGER_NAME} lists {n} chunks of input shard {i}; {fix}")
        done_rel = fmt.shard_done_path(i)
        if fmt.SHARD_DONE_NAME not in names:
            if inp.get("compression", "none") != "none":
                problems.append(f"{cache.display(done_rel)}: missing (every compressed shard of a finished build "
                                "has one); rerun the build command")
            continue
        try:
            done = fmt.load_json(cache.cat(done_rel))
        except ValueError as e:
            problems.append(f"{cache.display(done_rel)}: not valid JSON ({e}); rerun the build command")
            continue
        says = {k: done.get(k) for k in ("chunks", "uncompressed_bytes")} if isinstance(done, dict) else {}
        want = {"chunks": n, "uncompressed_bytes": inp.get("uncompressed_bytes")}
        differ = [k for k in want if want[k] is not None and says.get(k) != want[k]]
        if differ:
            problems.append(f"{cache.display(done_rel)}: says " + ", ".join(f"{k} {says.get(k)!r}" for k in differ)
                            + f"; {fmt.LEDGER_NAME} says " + ", ".join(f"{k} {want[k]!r}" for k in differ)
                            + f" for input shard {i}; {fix}")
    return problems


def _read(cache: Cache, rel: str) -> bytes | None:
    try:
        return cache.cat(rel)
    except FileNotFoundError:
        return None


def _show(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:18] + "..." + s[-18:]


def validate_chunk(cache: Cache, index: int, *, decode: bool = True, entry: dict[str, Any] | None = None) -> list[str]:
    """Problems with global chunk ``index`` (empty list if it is sound), each naming the damaged file:
    the Parquet file, its sidecar, or the ledger (version 4: its table) (see the module docstring). ``entry``:
    what it records of the chunk, if the caller fetched it (``reader.format.table.recorded_rows``)."""
    t = cache.table
    rel = t.paths[index]
    side_rel = fmt.sidecar_path(int(t.shard[index]), int(t.index_in_shard[index]))
    table = chunk_table.table_of(t)
    ledger_rel = table.desc["path"] if table is not None else fmt.LEDGER_NAME
    shown = cache.display
    problems: list[str] = []
    data = _read(cache, rel)
    raw = _read(cache, side_rel)
    side = None
    if raw is None:
        problems.append(f"{shown(side_rel)}: sidecar missing (the ledger lists its chunk)")
    else:
        try:
            side = fmt.load_json(raw)
        except ValueError as e:
            problems.append(f"{shown(side_rel)}: damaged sidecar: not valid JSON ({e})")
        else:
            if not isinstance(side, dict):
                problems.append(f"{shown(side_rel)}: damaged sidecar: not a JSON object")
                side = None
    if entry is None and cache.complete:
        entry = chunk_table.recorded_rows(t, cache.ledger.raw, [index])[index]
    want_bytes, want_sum = int(t.nbytes[index]), t.checksums[index]
    side_trusted = side is not None and entry is None  # during a build the table is the sidecars
    ledger_blamed = False
    if entry is not None and side is not None:
        recorded = entry.get("sidecar_checksum")  # None in ledgers written before sidecars were checksummed
        side_vouched = recorded is not None and recorded == fmt.checksum(raw)
        side_sum_ok = recorded is None or side_vouched
        got, want = entry_fields(side), entry_fields(entry)
        keys = set(want) if table is not None else set(got) | set(want)  # (a table records some of the keys)
        differ = sorted(k for k in keys if got.get(k) != want.get(k))
        file_backs_side = (data is not None and len(data) == side.get("bytes")
                           and fmt.checksum(data) == side.get("checksum"))
        if differ and (side_vouched or file_backs_side):
            # the sidecar is vouched for (by the ledger's own sidecar_checksum, or by the chunk file): the
            # ledger entry is the odd one out
            ledger_blamed = True
            side_trusted = True
            says = ", ".join(f"{k} {_show(want.get(k))}" for k in differ)
            other = ", ".join(f"{_show(got.get(k))}" for k in differ)
            witness = "the chunk file and its sidecar" if file_backs_side else "its sidecar (checksum verified)"
            problems.append(f"{shown(ledger_rel)}: the entry of chunk {index} ({rel}) says {says}; {witness} say "
                            f"{other}. The {'table' if table else 'ledger'} was changed after the build: restore it, or rebuild")
        elif differ:
            problems.append(f"{shown(side_rel)}: damaged sidecar: differs from the ledger entry in {differ}"
                            + (" (and its sha256 from the ledger's sidecar_checksum)" if recorded else ""))
        elif not side_sum_ok:
            # same entry fields: the damage is in the row-group index, the footer entry or the layout
            canonical = raw == sidecar_bytes(side)
            try:  # the file is the recorded one and the sidecar's row-group index agrees with it
                lay = Layout.of(side, want_bytes, int(t.docs[index]), int(t.tokens[index]))
                index_ok = data is not None and lay is not None and lay.check_file(data, want_sum) is not None
            except Disagreement:
                index_ok = False
            if canonical and index_ok:
                problems.append(f"{shown(ledger_rel)}: the entry of chunk {index} ({rel}) says sidecar_checksum "
                                f"{entry.get('sidecar_checksum')}, its sidecar (which matches the chunk file) has "
                                f"{fmt.checksum(raw)}. The ledger was changed after the build: restore it, or rebuild")
                ledger_blamed = side_trusted = True
            else:
                problems.append(f"{shown(side_rel)}: damaged sidecar: its sha256 is {fmt.checksum(raw)}, the ledger "
                                f"says {entry.get('sidecar_checksum')}"
                                + ("" if index_ok else " (its row_group_index/footer do not match the chunk file)"))
        else:
            side_trusted = True
    record = None
    if ledger_blamed and side is not None:  # judge the file by its sidecar instead of the changed entry
        record = {k: side[k] for k in ("bytes", "checksum", "docs", "tokens", "loss_tokens") if k in side}
        want_bytes, want_sum = int(record.get("bytes", want_bytes)), record.get("checksum", want_sum)
    if data is None:
        problems.append(f"{shown(rel)}: missing (the ledger lists it)")
        return problems
    rg_index = side.get("row_group_index") if side_trusted else None
    footer = side.get("footer") if side_trusted else None
    wrong = file_mismatch(data, want_bytes, want_sum, rg_index, footer)
    if wrong:
        problems.append(f"{shown(rel)}: {wrong}")
        return problems
    problems += _check_layout(cache, index, data, decode, side if side_trusted else None, record)
    if side_trusted:  # the dead letters against the sidecar that vouches for them (path, sha256, lines)
        wrong = dead_letters_problem(side, lambda rel: _read(cache, rel))
        if wrong:
            where = side.get("dead_letters") or fmt.dead_letter_path(int(t.shard[index]), int(t.index_in_shard[index]))
            problems.append(f"{shown(where)}: {wrong} (of chunk {rel}); rerun the build command, which writes it "
                            "again")
    return problems


def _check_loss_column(cache: Cache, rel: str, pf: pq.ParquetFile) -> bool:
    """Whether the chunk has the ``loss_spans`` column, as its cache's ledger says it must (or must not)."""
    has = fmt.LOSS_COLUMN in pf.schema_arrow.names
    if has != cache.ledger.masked:
        fmt_name = cache.ledger.config.get("record_format", fmt.PLAIN_RECORD_FORMAT)
        raise chunk_error(cache, rel, f"{'a' if has else 'no'} {fmt.LOSS_COLUMN} column, but the ledger's "
                          f"config.record_format is {fmt_name!r}")
    return has


def _loss_tokens(cache: Cache, rel: str, g: int, col, lengths: np.ndarray) -> int:
    """Loss tokens of row group ``g`` (its ``loss_spans`` column ``col``), its spans checked (sorted, disjoint,
    non-empty, within their documents)."""
    try:
        if col.null_count:
            raise ValueError(f"null {fmt.LOSS_COLUMN} lists")
        loss_flags(int_values(col.flatten()), np.diff(int_values(col.offsets)), lengths, strict=True)
    except ValueError as e:
        raise chunk_error(cache, rel, f"row group {g}: {e}") from None
    return loss_tokens(col)


def _check_layout(cache: Cache, index: int, data: bytes, decode: bool, side: dict | None,
                  record: dict | None) -> list[str]:
    """Problems of a file whose bytes match the record: its Parquet layout, counts, decoded row groups."""
    t = cache.table
    rel = t.paths[index]
    side_rel = fmt.sidecar_path(int(t.shard[index]), int(t.index_in_shard[index]))
    try:
        m = parse_chunk(cache, index, data, record)
        if decode:
            vocab = cache.ledger.tokenizer.get("vocab_size")
            pf = pq.ParquetFile(pa.BufferReader(m.data))
            masked = _check_loss_column(cache, rel, pf)
            loss = 0
            for g in range(pf.metadata.num_row_groups):
                tab = pf.read_row_group(g, columns=[fmt.TOKEN_COLUMN] + [fmt.LOSS_COLUMN] * masked)
                ids = int_values(tab.column(0).combine_chunks().flatten())
                want = int(m.rg_token_starts[g + 1] - m.rg_token_starts[g])
                if ids.size != want:
                    raise chunk_error(cache, rel, f"row group {g} decodes to {ids.size} tokens, metadata says {want}")
                if vocab is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                    bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                    return [f"{cache.display(rel)}: row group {g} holds token id {bad}, outside the vocabulary [0, "
                            f"{vocab}) of the ledger's tokenizer ({cache.ledger.tokenizer.get('spec')}): the ledger's "
                            "tokenizer was changed after the build (restore it), or the chunk was written with another "
                            "tokenizer (rebuild)"]
                if masked:
                    loss += _loss_tokens(cache, rel, g, tab.column(1).combine_chunks(),
                                         m.doc_lengths[m.rg_doc_starts[g]:m.rg_doc_starts[g + 1]])
            if masked:
                t = cache.table
                want = (record or {}).get("loss_tokens", None if t.loss_tokens is None else int(t.loss_tokens[index]))
                if want != loss:
                    raise chunk_error(cache, rel, f"its loss spans cover {loss} tokens, the "
                                      f"{'sidecar' if record or not cache.complete else 'ledger'} says loss_tokens "
                                      f"{want}")
    except fmt.FormatError as e:
        return [str(e).split(". The file does not match")[0]]
    except Exception as e:  # noqa: BLE001 - report, never crash the validator
        return [f"{cache.display(rel)}: cannot be decoded ({type(e).__name__}: {arrow_message(e)})"]
    if side is None:
        return []
    try:  # the file is the recorded one (checked by the caller): the rest of the sidecar must agree with it
        lay = Layout.of(side, len(data), len(m.doc_lengths), int(m.doc_starts[-1]))
        if lay is not None:
            lay.check_file(data, None)
    except Disagreement:
        return [f"{cache.display(side_rel)}: damaged sidecar: its row_group_index/footer do not match the chunk file"]
    if lay is None:
        return [f"{cache.display(side_rel)}: no row_group_index/footer (sidecar written by an older chunkledger; "
                "readers fetch this chunk whole: rebuild to index it)"]
    return []
