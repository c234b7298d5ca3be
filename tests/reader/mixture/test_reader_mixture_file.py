"""The mixture file (reader/mixture/mixture_file.py): every kind of bad input is a clear error naming the file and
the key; relative paths; and the command line (`inspect MIXTURE.json`, `batches MIXTURE.json`)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import cachegen
from mixgen import write_components, write_mixture
from reader import ReadOptions, Reader
from reader.cli.main import main as cli_main
from reader.mixture.quotas import QuotaIndex
from reader.mixture.mixture import Mixture
from reader.mixture.mixture_file import MixtureError, is_mixture_path, load_mixture, parse_mixture
from reader.storage.whatis import NotACache


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixfile")
    paths, _ = write_components(str(root), [5, 4])
    other = str(root / "other-tok")
    cachegen.write_synthetic_cache(other, [[[1, 2, 3]]], tokenizer={
        "spec": "tiktoken:cl100k_base", "kind": "tiktoken", "vocab_size": 100277, "eos_id": 100257,
        "hash": "sha256:9e6380b25"})
    return root, paths


def good(**over):
    doc = {"mixture": 1, "components": [{"name": "web", "path": "c0", "weight": 0.7},
                                        {"name": "code", "path": "c1", "weight": 0.3}],
           "schedule": [{"start_batch": 10, "weights": {"web": 0.4, "code": 0.6}}], "seed": 0}
    doc.update(over)
    return doc


def error_of(root, doc, name="bad.json") -> str:
    path = os.path.join(root, name)
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(MixtureError) as e:
        Reader(path, ReadOptions(seq_len=8, batch_size=8))
    msg = str(e.value)
    assert msg.startswith(path + ":"), msg  # every error names the file
    return msg


BAD = [
    ("unknown top-level key", lambda: good(weights=[1]), ["unknown key 'weights'", "allowed: mixture, components"]),
    ("unknown component key", lambda: good(components=[{"name": "web", "path": "c0", "weight": 1, "epochs": 2}],
                                           schedule=[]),
     ["components[0]", "'epochs'"]),
    ("unknown schedule key", lambda: good(schedule=[{"start_batch": 5, "weights": {"web": 1}, "warmup": 3}]),
     ["schedule[0]", "'warmup'"]),
    ("negative weight", lambda: good(components=[{"name": "web", "path": "c0", "weight": -0.1},
                                                 {"name": "code", "path": "c1", "weight": 1}]),
     ["components[0].weight", "negative"]),
    ("all-zero weights", lambda: good(components=[{"name": "web", "path": "c0", "weight": 0},
                                                  {"name": "code", "path": "c1", "weight": 0}], schedule=[]),
     ["components[*].weight", "every weight is 0"]),
    ("all-zero schedule weights", lambda: good(schedule=[{"start_batch": 5, "weights": {"web": 0}}]),
     ["schedule[0].weights", "every weight is 0"]),
    ("weight below the block minimum", lambda: good(components=[{"name": "web", "path": "c0", "weight": 1},
                                                                {"name": "code", "path": "c1", "weight": 0.0005}]),
     ["components[1].weight", "'code'", "block minimum 1/1024",
      "larger \"block\" (e.g. 2048)"]),
    ("schedule weight below the block minimum", lambda: good(block=16, schedule=[
        {"start_batch": 5, "weights": {"web": 1, "code": 0.01}}]),
     ["schedule[0].weights.code", "1/16"]),
    ("missing component path", lambda: good(components=[{"name": "web", "path": "nowhere", "weight": 1}], schedule=[]),
     ["components[0].path", "'web'", "nowhere", "does not exist"]),
    ("duplicate names", lambda: good(components=[{"name": "web", "path": "c0", "weight": 1},
                                                 {"name": "web", "path": "c1", "weight": 1}]),
     ["components[1].name", "'web' is used twice"]),
    ("schedule not increasing", lambda: good(schedule=[{"start_batch": 10, "weights": {"web": 1}},
                                                       {"start_batch": 10, "weights": {"code": 1}}]),
     ["schedule[1].start_batch", "must be greater"]),
    ("schedule at batch 0", lambda: good(schedule=[{"start_batch": 0, "weights": {"web": 1}}]),
     ["schedule[0].start_batch", "in [1, "]),
    ("schedule at batch 2**63", lambda: good(schedule=[{"start_batch": 1 << 63, "weights": {"web": 1}}]),
     ["schedule[0].start_batch must be an integer in [1, 1099511627776], got 9223372036854775808"]),
    ("a weight of 400 digits", lambda: good(components=[{"name": "web", "path": "c0", "weight": 10 ** 400},
                                                        {"name": "code", "path": "c1", "weight": 1}]),
     ["components[0].weight is 1000", "(401 characters), above the largest weight 2**53"]),
    ("a weight too small to be represented", lambda: good(components=[{"name": "web", "path": "c0", "weight": 1},
                                                                      {"name": "code", "path": "c1", "weight": 1e-10}]),
     ["components[1].weight", "'code'", "normalised weight 1e-10, too small to be represented",
      "multiples of 2**-32 (2.33e-10)", "at least 1/block (0.000977 with block 1024", "9.54e-07 with the largest"]),
    ("a schedule weight too small to be represented", lambda: good(schedule=[
        {"start_batch": 5, "weights": {"web": 1, "code": 1e-12}}]), ["schedule[0].weights.code", "too small"]),
    ("JSON nested 200k deep", lambda: '{"mixture": 1, "components": ' + "[" * 200_000 + "]" * 200_000 + "}",
     ["not valid JSON (nested too deep)"]),
    ("schedule naming an unknown component", lambda: good(schedule=[{"start_batch": 5, "weights": {"books": 1}}]),
     ["schedule[0].weights", "unknown component 'books'", "components: web, code"]),
    ("mismatched tokenizers", lambda: good(components=[{"name": "web", "path": "c0", "weight": 1},
                                                       {"name": "gpt", "path": "other-tok", "weight": 1}],
                                             schedule=[]),
     ["components[1].path", "'gpt'", "tiktoken:cl100k_base", "'web'", "synthetic"]),
    ("wrong version", lambda: good(mixture=2), ['"mixture" must be 1']),
    ("not JSON", lambda: "{\"mixture\": 1,", ["not valid JSON"]),
    ("NaN weight", lambda: '{"mixture": 1, "components": [{"name": "a", "path": "c0", "weight": NaN}]}',
     ["not valid JSON", "NaN"]),
    ("string weight", lambda: good(components=[{"name": "web", "path": "c0", "weight": "0.5"}], schedule=[]),
     ["components[0].weight", "finite number"]),
    ("no components", lambda: good(components=[]), ["\"components\" must be a non-empty list"]),
    ("bad block", lambda: good(block=0), ["block must be an integer"]),
    ("max_passes 0", lambda: good(components=[{"name": "web", "path": "c0", "weight": 1, "max_passes": 0}],
                                  schedule=[]),
     ["components[0].max_passes must be a number in (0, 2**40]", "got 0"]),
    ("max_passes a string", lambda: good(components=[{"name": "web", "path": "c0", "weight": 1, "max_passes": "2"}],
                                         schedule=[]),
     ["components[0].max_passes must be a number"]),
]


@pytest.mark.parametrize("what,doc,expect", BAD, ids=[b[0] for b in BAD])
def test_bad_mixture_files_are_clear_errors(caches, what, doc, expect):
    root, _ = caches
    msg = error_of(str(root), doc())
    for part in expect:
        assert part in msg, (what, msg)


def test_a_ledger_is_not_a_mixture(caches):
    root, _ = caches
    path = os.path.join(str(root), "c0", "ledger.json")
    with pytest.raises(NotACache, match="this is the ledger file itself; pass its directory"):
        Reader(path, ReadOptions())
    with pytest.raises(MixtureError, match="cache's ledger, not a mixture file; pass the cache directory"):
        parse_mixture(open(path, "rb").read(), path)
    assert is_mixture_path(path) and is_mixture_path("gs://b/m.JSON") and not is_mixture_path(os.path.dirname(path))


def test_relative_paths_are_relative_to_the_file(tmp_path):
    spec = parse_mixture(json.dumps(good(components=[{"name": "a", "path": "../web", "weight": 1},
                                                     {"name": "b", "path": "/abs/code", "weight": 1},
                                                     {"name": "c", "path": "gs://x/books/train", "weight": 1}],
                                         schedule=[])), "gs://bucket/mix/m.json")
    assert [c.url for c in spec.components] == ["gs://bucket/web", "/abs/code", "gs://x/books/train"]
    local = parse_mixture(json.dumps(good(schedule=[])), str(tmp_path / "sub" / "m.json"))
    assert local.components[0].url == str(tmp_path / "sub" / "c0")
    assert local.normalised(0) == pytest.approx((0.7, 0.3))


def test_a_split_of_a_cache_is_a_component(tmp_path):
    """A component may be one split of a cache built with a validation fraction (OUTPUT/train/, itself a
    complete cache), relative to the file."""
    write_components(str(tmp_path / "out"), [3])
    os.rename(tmp_path / "out" / "c0", tmp_path / "out" / "train")
    f = write_mixture(str(tmp_path / "m.json"), [("train", "out/train", 1)])
    with Reader(f, ReadOptions(seq_len=4, batch_size=4, ideal_readers=2)) as r:
        assert (r.batch(0)["components"] == 0).all()


def test_inspect_prints_weights_and_passes(caches, capsys):
    root, paths = caches
    f = write_mixture(os.path.join(str(root), "ok.json"), [("web", "c0", 3), ("code", "c1", 1)],
                      schedule=[(40, {"code": 1})], block=16)
    assert cli_main(["inspect", f, "--steps", "100", "--seq_len", "4", "--batch_size", "8",
                     "--ideal_readers", "4"]) == 0
    out = capsys.readouterr().out
    assert "from batch 0" in out and "from batch 40" in out and "0.7500" in out and "0.2500" in out
    drawn = QuotaIndex(Mixture(f).spec.quotas(4, 8)).consumed(800).tolist()
    assert drawn == [240, 560]  # 40 batches x 8 x 3/4, then the rest of code
    assert f"{drawn[0]:,}" in out and "passes" in out
    assert cli_main(["inspect", f, "--steps", "100", "--seq_len", "4", "--batch_size", "8", "--ideal_readers",
                     "4", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    tokens = [c["tokens"] for c in info["components"]]
    assert [c["examples_drawn"] for c in info["components"]] == drawn
    # a pass is the component's whole rows of seq_len tokens (its eval pass's rows)
    assert [c["examples_per_pass"] for c in info["components"]] == [t // 4 for t in tokens]
    assert [c["passes"] for c in info["components"]] == pytest.approx([d / (t // 4) for d, t in zip(drawn, tokens)])
    assert [c["pass_rule"] for c in info["components"]] == ["streams"] * 2  # (format version 2 caches)
    assert info["segments"][1] == {"start_batch": 40, "weights": {"web": 0.0, "code": 1.0}}
    assert cli_main(["inspect", os.path.join(str(root), "missing.json")]) == 2
    assert "no such mixture file" in capsys.readouterr().err


def test_inspect_and_batches_say_which_step_max_passes_refuses(caches, tmp_path, capsys):
    root, _ = caches
    doc = {"mixture": 1, "components": [{"name": "web", "path": "c0", "weight": 3},
                                        {"name": "code", "path": "c1", "weight": 1, "max_passes": 1.5}]}
    f = os.path.join(str(root), "limited.json")
    with open(f, "w") as fh:
        json.dump(doc, fh)
    args = ["--seq_len", "4", "--batch_size", "8", "--ideal_readers", "4"]
    with Reader(f, ReadOptions(seq_len=4, batch_size=8, ideal_readers=4)) as r:
        step = r.order.pass_limit()[0]
    assert cli_main(["inspect", f, "--steps", str(step), *args]) == 0
    assert "max_passes refuses" not in capsys.readouterr().out
    assert cli_main(["inspect", f, "--steps", str(step + 1), *args]) == 0
    out = capsys.readouterr().out
    assert f"WARNING: max_passes refuses step {step:,}: {f}: component 'code' has max_passes 1.5" in out
    npz = str(tmp_path / "b.npz")
    assert cli_main(["batches", f, *args, "--start", str(step - 1), "--count", "2", "--out", npz]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {f}: component 'code' has max_passes 1.5") and len(err.splitlines()) == 1


def test_batches_command_reads_a_mixture(caches, tmp_path):
    root, _ = caches
    f = write_mixture(os.path.join(str(root), "cli.json"), [("web", "c0", 1), ("code", "c1", 1)], block=8)
    out = str(tmp_path / "b.npz")
    assert cli_main(["batches", f, "--seq_len", "4", "--batch_size", "8", "--ideal_readers", "2", "--start", "3",
                     "--count", "2", "--shuffle_seed", "1", "--out", out]) == 0
    z = np.load(out)
    with Reader(f, ReadOptions(seq_len=4, batch_size=8, ideal_readers=2, shuffle_seed=1)) as r:
        for i in range(2):
            want = r.batch(3 + i)
            assert np.array_equal(z["components"][i], want["components"])
            assert np.array_equal(z["targets"][i], want["targets"])
    assert set(np.unique(z["components"])) == {0, 1}


def test_load_mixture_reads_urls(tmp_path):
    """The file may be any fsspec URL; relative components then resolve against that URL."""
    path = write_mixture(str(tmp_path / "m.json"), [("a", "c0", 1)])
    spec = load_mixture("file://" + path)
    assert spec.components[0].url == "file://" + str(tmp_path / "c0")
