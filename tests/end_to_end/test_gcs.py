"""gs:// end to end against a local Cloud Storage emulator (gcp-storage-emulator on 127.0.0.1).

The pipeline reads gs:// shards and writes a gs:// cache (Beam's GCS filesystem pointed at the emulator);
the reader reads it through gcsfs. Both must equal a local build of the same files: same chunk bytes,
same ledger (but for the input paths it records), same batches. A build SIGKILLed mid-write on gs://
(where a rename is copy + delete) resumes to the same bytes, and a reader following a running gs://
build gets the batches it gets after the build.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("gcsfs", reason="the gcs extra (gcsfs) is not installed")
pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (test extra) is not installed")

from build_helpers import write_shard  # noqa: E402
from gcs_emulator import GcsEmulator  # noqa: E402
from pipelines import build_cache  # noqa: E402
from reader import ReadOptions, Reader  # noqa: E402
from reader.format import spec as fmt  # noqa: E402
from reader.format import table as chunk_table  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests", "support")
SAMPLE = os.path.join(REPO, "pipelines", "sample_corpus")
CHUNK = 40000
FNAPI = ["--runner=FnApiRunner"]
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # builds against the emulator: make test only


def argv(inputs: str, output: str, *extra: str) -> list[str]:
    return ["--input", inputs, "--output", output, "--tokenizer", "tiktoken:cl100k_base", "--append_eos",
            "--chunk_bytes", str(CHUNK), "--row_group_tokens", "3000", *extra]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The sample corpus (3 plain shards + 1 gzip) plus a zstd shard, as local files."""
    d = tmp_path_factory.mktemp("gcs_corpus")
    paths = []
    for p in sorted(glob.glob(os.path.join(SAMPLE, "*"))):
        dst = d / os.path.basename(p)
        dst.write_bytes(open(p, "rb").read())
        paths.append(str(dst))
    with open(paths[0], encoding="utf-8") as f:
        lines = [json.loads(ln) for ln in f][:60]
    paths.append(write_shard(str(d / "part-04.jsonl.zst"), lines))
    return d, paths


@pytest.fixture(scope="module")
def local_cache(corpus, tmp_path_factory):
    d, _ = corpus
    out = str(tmp_path_factory.mktemp("gcs_local") / "cache")
    build_cache.run(argv(str(d / "*"), out, *FNAPI))
    return out


@pytest.fixture(scope="module")
def emulator(corpus):
    d, paths = corpus
    with GcsEmulator(bucket="chunkledger-test") as emu:
        for p in paths:
            emu.upload(p, "corpus/" + os.path.basename(p))
        yield emu


def gs_tree(emu: GcsEmulator, prefix: str) -> dict[str, bytes]:
    fs = emu.gcsfs()
    fs.invalidate_cache()
    root = f"{emu.bucket}/{prefix}"
    return {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root)}


def local_tree(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def normalized_ledger(raw: bytes, corpus_prefix: str) -> dict:
    """The ledger without what names the storage: input paths, and gs:// objects' CRC32C (None locally)."""
    ledger = json.loads(raw)
    for inp in ledger["inputs"]:
        assert inp["path"].startswith(corpus_prefix), (inp["path"], corpus_prefix)
        inp["path"] = os.path.basename(inp["path"])
        assert (inp.pop("crc32c") is not None) == corpus_prefix.startswith("gs://"), inp
    return ledger


def assert_same_cache(gs_files: dict[str, bytes], local_files: dict[str, bytes], gs_prefix: str, local_prefix: str):
    assert sorted(gs_files) == sorted(local_files)
    assert not [k for k in gs_files if ".tmp-" in k], "temporary objects left behind on gs://"
    for k in local_files:
        if k == "ledger.json":
            assert normalized_ledger(gs_files[k], gs_prefix) == normalized_ledger(local_files[k], local_prefix)
        else:
            assert gs_files[k] == local_files[k], f"{k} differs between the gs:// and the local build"


def batches(reader: Reader, bs) -> list[dict[str, np.ndarray]]:
    return [reader.batch(b) for b in bs]


def assert_same_batches(a: list[dict], b: list[dict]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_gs_build_and_gcsfs_reads_equal_a_local_build(corpus, local_cache, emulator):
    d, _ = corpus
    with emulator.beam_env():
        res = build_cache.run(argv(emulator.url("corpus/*"), emulator.url("cache"), *FNAPI))
    assert res["ledger"]["finished"] and res["ledger"]["totals"]["chunks"] > 12
    assert {i["compression"] for i in res["ledger"]["inputs"]} == {"none", "gzip", "zstd"}
    assert_same_cache(gs_tree(emulator, "cache"), local_tree(local_cache), emulator.url("corpus/"), str(d) + "/")

    so = emulator.storage_options
    for opts, bs in [(ReadOptions(seq_len=64, batch_size=8, ideal_readers=4, index_cache=False), [0, 1, 7, 40]),
                     (ReadOptions(seq_len=96, batch_size=6, packed=False, ideal_readers=2, index_cache=False),
                      [0, 3, 25]),
                     (ReadOptions(seq_len=128, batch_size=16, eval_mode=True, index_cache=False), None)]:
        local = Reader(local_cache, opts)
        remote = Reader(emulator.url("cache"), opts, storage_options=so)
        if bs is None:  # eval: the whole single pass, including the padded last batch
            assert remote.num_batches == local.num_batches and local.num_batches > 3
            bs = range(local.num_batches)
        got = batches(remote, bs)
        assert_same_batches(got, batches(local, bs))
        assert any(g["inputs"].any() for g in got)
        # two reader hosts over gs:// assemble the same global batch
        halves = [Reader(emulator.url("cache"), opts, num_readers=2, reader_index=r, storage_options=so)
                  for r in range(2)]
        b0 = list(bs)[-1]
        joined = {k: np.concatenate([h.batch(b0)[k] for h in halves]) for k in got[-1]}
        rows = np.concatenate([h.my_rows for h in halves])
        full = remote.rows(b0, rows)
        for k in joined:
            np.testing.assert_array_equal(joined[k], full[k], err_msg=k)


def test_progress_lists_a_gs_output(corpus, emulator):
    """The progress line's numbers from a gs:// output: listed and read through Beam's GCS filesystem, a
    compressed shard's total sampled from its object while its _DONE.json is missing."""
    from pipelines.launcher import plan_build
    from pipelines.options import parse_args
    from pipelines.runners import progress_line

    out = emulator.url("progress")
    fs = emulator.gcsfs()
    with emulator.beam_env():
        res = build_cache.run(argv(emulator.url("corpus/*"), out, *FNAPI))
        plan = plan_build(parse_args(argv(emulator.url("corpus/*"), out))).plan
        scanner = progress_line.Scanner(out, plan)
        done = scanner.scan()
        gz = next(i for i in plan.inputs if i.compression == "gzip")
        fs.rm(f"{emulator.bucket}/progress/{fmt.shard_done_path(gz.shard)}")
        entry = f"{emulator.bucket}/progress/{chunk_table.entry_path(0, 0)}"  # (a version 4 chunk's completion)
        first = json.loads(fs.cat_file(entry))
        fs.rm(entry)
        running = scanner.scan()
    t, ledger = res["ledger"]["totals"], res["ledger"]
    assert scanner.remote
    assert (done.docs, done.tokens, done.done_bytes, done.total_bytes, done.estimated) == (
        t["docs"], t["tokens"], t["uncompressed_bytes"], t["uncompressed_bytes"], False)
    assert (done.docs - running.docs, done.done_bytes - running.done_bytes) == (first["docs"], CHUNK)
    # the gzip object decoded whole: its ratio is exact, so the estimate is the total (to float rounding)
    assert running.estimated and abs(running.total_bytes - t["uncompressed_bytes"]) <= 1


def test_gs_rerun_trusts_inputs_by_crc32c_and_rereads_a_replaced_object(corpus, emulator):
    """The ledger records each object's CRC32C; a rerun reads no input whose CRC32C is unchanged, and an
    object replaced by other bytes of the same size is read again and its changed chunk rebuilt."""
    import base64

    import google_crc32c

    d, paths = corpus
    for p in paths:
        emulator.upload(p, "crc/" + os.path.basename(p))
    with emulator.beam_env():
        res = build_cache.run(argv(emulator.url("crc/*"), emulator.url("crc-cache"), *FNAPI))
        for inp, p in zip(res["ledger"]["inputs"], sorted(paths)):
            want = base64.b64encode(google_crc32c.Checksum(open(p, "rb").read()).digest()).decode()
            assert inp["crc32c"] == want
        again = build_cache.run(argv(emulator.url("crc/*"), emulator.url("crc-cache"), *FNAPI))
        assert again["already_complete"] and again["counters"].get("chunks_input_changed", 0) == 0
        # an unfinished build whose plain shard is replaced by other bytes of the same size
        ledger = json.loads(emulator.gcsfs().cat_file(f"{emulator.bucket}/crc-cache/ledger.json"))
        plain = sorted(paths)[0]
        assert plain.endswith(".jsonl")
        data = bytearray(open(plain, "rb").read())
        at = data.index(b"the ")
        data[at:at + 4] = b"THE "
        edited = d.parent / "edited.jsonl"
        edited.write_bytes(bytes(data))
        emulator.upload(edited, "crc/" + os.path.basename(plain))
        ledger.update(finished=False, chunks=[], totals={}, bad_records={})
        for inp in ledger["inputs"]:
            inp.pop("uncompressed_bytes")
            if inp["compression"] != "none":
                inp["chunks"] = None
        with emulator.gcsfs().open(f"{emulator.bucket}/crc-cache/ledger.json", "wb") as f:
            f.write(fmt.dumps_ledger(ledger).encode())
        res = build_cache.run(argv(emulator.url("crc/*"), emulator.url("crc-cache"), *FNAPI))
    assert res["counters"]["chunks_input_changed"] == 1 and res["counters"]["chunks_written"] == 1
    assert res["ledger"]["inputs"][0]["crc32c"] != ledger["inputs"][0]["crc32c"]


def test_gs_split_build_equals_a_local_one_and_its_rerun_only_verifies(corpus, emulator, tmp_path):
    """A split build on gs://: the manifest and both caches as a local split build writes them (the lock and
    every temporary object gone); a rerun trusts the inputs' CRC32C in both caches and changes nothing."""
    from reader.storage.whatis import NotACache

    d, _ = corpus
    split = ("--validation_fraction", "0.25", "--split_seed", "3")
    local = str(tmp_path / "split")
    build_cache.run(argv(str(d / "*"), local, *split, *FNAPI))
    with emulator.beam_env():
        res = build_cache.run(argv(emulator.url("corpus/*"), emulator.url("split"), *split, *FNAPI))
        assert res["splits"]["validation"]["totals"]["docs"] > 0
        before = gs_tree(emulator, "split")
        again = build_cache.run(argv(emulator.url("corpus/*"), emulator.url("split"), *split, *FNAPI))
    assert again["already_complete"] and again["counters"].get("chunks_written", 0) == 0
    assert gs_tree(emulator, "split") == before
    assert sorted({k.split("/")[0] for k in before}) == ["splits.json", "train", "validation"]
    assert before["splits.json"] == open(os.path.join(local, "splits.json"), "rb").read()
    for name in ("train", "validation"):
        assert_same_cache(gs_tree(emulator, f"split/{name}"), local_tree(os.path.join(local, name)),
                          emulator.url("corpus/"), str(d) + "/")
    opts = ReadOptions(seq_len=64, batch_size=4, ideal_readers=2, index_cache=False)
    top = emulator.url("split")
    with pytest.raises(NotACache, match=f"it is a split build .*; use {top}/train or {top}/validation"):
        Reader(top, opts, storage_options=emulator.storage_options)
    val = Reader(f"{top}/validation", opts, storage_options=emulator.storage_options)
    assert val.cache.complete and val.cache.ledger.raw["config"]["split"]["name"] == "validation"


def test_gs_build_killed_mid_write_resumes_to_the_same_bytes(corpus, local_cache, emulator):
    """SIGKILL between a temporary object's write and its rename (copy + delete on GCS), then rerun."""
    d, _ = corpus
    out = emulator.url("killed")
    # Run the build in a subprocess that connects to the emulator anonymously (no 20 s credential retries).
    code = ("import sys; from apache_beam.internal.gcp import auth; "
            "auth._Credentials._credentials_init = True; "
            f"sys.path.insert(0, {TESTS!r}); import kill_at; kill_at.kill_at_write('7:before_rename'); "
            "from pipelines.build_cache import main; main(sys.argv[1:])")
    env = dict(os.environ, STORAGE_EMULATOR_HOST=emulator.endpoint, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    proc = subprocess.run([sys.executable, "-c", code, *argv(emulator.url("corpus/*"), out, *FNAPI)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    partial = gs_tree(emulator, "killed")
    assert json.loads(partial["ledger.json"])["finished"] is False
    assert any(".tmp-" in k for k in partial), "the kill point should leave a temporary object"
    # A reader sees the running build's plan and no half-written chunk.
    opts = ReadOptions(seq_len=64, batch_size=4, ideal_readers=2, index_cache=False)
    mid = Reader(out, opts, storage_options=emulator.storage_options, wait_timeout_s=0.1)
    assert not mid.cache.complete

    with emulator.beam_env():
        res = build_cache.run(argv(emulator.url("corpus/*"), out, *FNAPI))
    assert res["resumed"]
    assert_same_cache(gs_tree(emulator, "killed"), local_tree(local_cache), emulator.url("corpus/"), str(d) + "/")


def test_reading_a_gs_cache_during_its_build_matches_reading_after(emulator):
    """A reader polling a gs:// cache through gcsfs while the build writes it gets the final batches."""
    import time

    out = emulator.url("live")
    code = ("import sys; from apache_beam.internal.gcp import auth; "
            "auth._Credentials._credentials_init = True; "
            "from pipelines.build_cache import main; main(sys.argv[1:])")
    env = dict(os.environ, STORAGE_EMULATOR_HOST=emulator.endpoint, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    args = ["--input", emulator.url("corpus/*"), "--output", out, "--tokenizer", "tiktoken:cl100k_base",
            "--chunk_bytes", "8192", *FNAPI]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    so = emulator.storage_options
    specs = {"train": ReadOptions(seq_len=50, batch_size=4, ideal_readers=2, index_cache=False),
             "eval": ReadOptions(seq_len=50, batch_size=4, eval_mode=True, index_cache=False)}
    try:
        fs = emulator.gcsfs()
        deadline = time.time() + 120
        while True:
            fs.invalidate_cache()
            if fs.exists(f"{emulator.bucket}/live/ledger.json"):
                break
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "the build never wrote its plan"
            time.sleep(0.05)
        live = {name: Reader(out, o, num_readers=2, reader_index=1, wait_timeout_s=180, poll_interval_s=0.05,
                             storage_options=so) for name, o in specs.items()}
        opened_during_build = not live["train"].cache.complete
        runs = {name: [(b, x) for b, x in rd.iter_batches(0, 40)] for name, rd in live.items()}
        for rd in live.values():
            rd.close()
        assert proc.wait(timeout=180) == 0, proc.stdout.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert opened_during_build, "the build finished before the reader opened it; nothing was tested"
    for name, o in specs.items():
        after = Reader(out, o, num_readers=2, reader_index=1, storage_options=so)
        want = list(after.iter_batches(0, 40))
        after.close()
        assert [b for b, _ in runs[name]] == [b for b, _ in want]
        for (_, x), (_, y) in zip(runs[name], want):
            for k in x:
                np.testing.assert_array_equal(x[k], y[k], err_msg=f"{name} {k}")


def test_hf_tokenizer_on_gs_resolves_like_the_local_file(tmp_path, emulator):
    """A Dataflow launch reads no local files: an HF tokenizer.json (or its directory) on gs:// works."""
    from build_helpers import train_tiny_tokenizer
    from pipelines.tokenize.tokenizer import TokenizerError, resolve

    local = train_tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    # <pad> is not an EOS the resolver would guess: getting it proves tokenizer_config.json was read.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    emulator.upload(local, "tok/tokenizer.json")
    emulator.upload(tmp_path / "tokenizer_config.json", "tok/tokenizer_config.json")
    with emulator.beam_env():
        by_file = resolve(emulator.url("tok/tokenizer.json"))
        by_dir = resolve(emulator.url("tok/"))
        with pytest.raises(TokenizerError, match="no tokenizer.json"):
            resolve(emulator.url("missing/"))
    ref = resolve(local)
    from tokenizers import Tokenizer

    assert ref.eos_id == Tokenizer.from_file(local).token_to_id("<pad>")
    for got in (by_file, by_dir):
        assert (got.hash, got.vocab_size, got.eos_id) == (ref.hash, ref.vocab_size, ref.eos_id)
    text = "The quick brown fox jumps over the lazy dog."
    assert by_dir.load_reference().encode_many([text])[0].tolist() == ref.load_reference().encode_many([text])[0].tolist()


def test_columnar_and_json_array_inputs_on_gs_build_the_local_cache(tmp_path):
    """Parquet, Arrow, a JSON array and a save_to_disk directory on gs:// (read by byte ranges through gcsfs) build
    the local build's bytes."""
    from columnar_files import corpus_table, save_to_disk, write_arrow, write_json_array, write_parquet

    d = tmp_path / "in"
    d.mkdir()
    t = corpus_table(150, seed=8)
    write_parquet(d / "a.parquet", t, row_group_size=25)
    write_arrow(d / "b.arrow", t, batch_rows=40)
    write_json_array(d / "c.json", t)
    save_to_disk(d / "saved", t, num_shards=2)
    local = str(tmp_path / "local")
    args = ["--keep_fields", "source", *FNAPI]
    build_cache.run(argv(str(d / "*"), local, "--input", str(d / "saved"), *args))
    assert len(json.load(open(os.path.join(local, fmt.LEDGER_NAME)))["inputs"]) == 5
    with GcsEmulator(bucket="chunkledger-cols") as emu:
        for p in sorted(glob.glob(str(d / "**"), recursive=True)):
            if os.path.isfile(p):
                emu.upload(p, "in/" + os.path.relpath(p, d))
        with emu.beam_env():
            build_cache.run(argv(emu.url("in/*"), emu.url("cache"), "--input", emu.url("in/saved"), *args))
        assert_same_cache(gs_tree(emu, "cache"), local_tree(local), emu.url("in/"), str(d) + "/")
