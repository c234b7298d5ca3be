"""The Dataflow Flex Template (templates/) stays in step with the pipeline's options and the tested environment.

Nothing here needs docker, gcloud credentials or network: metadata.json is checked against the pipeline's
argparse parser (so adding an option without a template parameter fails here), against the Dataflow API's
own TemplateMetadata type, and (when gcloud is installed) against ``gcloud ... --print-only``; the Dockerfile
and requirements are checked for pins that match the Beam and packages the tests run with; the Makefile is
run in print mode and with RUN=1 against a recording fake ``gcloud``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates"

# templates/main.py is not a package module (the image runs it as a file); load it by path.
_spec = importlib.util.spec_from_file_location("chunkledger_template_main", TEMPLATES / "main.py")
template_main = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(template_main)

build_cache = pytest.importorskip("pipelines.build_cache", reason="the pipeline extra is not installed")

# A realistic value for each required parameter (optional ones are checked with their defaults).
EXAMPLES = {
    "input": ["gs://my-bucket/corpus/*.jsonl.gz", "gs://my-bucket/a/b/shard-000*.jsonl"],
    "output": ["gs://my-bucket/caches/c1", "gs://my-bucket"],
    "tokenizer": ["tiktoken:cl100k_base", "gpt2", "meta-llama/Llama-3.1-8B", "/template/tokenizers/t5"],
    "chunk_bytes": ["64MiB", "512KiB", "1048576"],
    "append_eos": ["true", "false"],
    "parquet_compression": ["snappy", "none"],
    "max_bad_fraction": ["0", "0.05", "1", ".5"],
    "validation_fraction": ["0.01", ".005", "0.5"],
    "split_seed": ["0", "17"],
    "keep_fields": ["source,url", "metadata.lang"],
    "record_format": ["chat", "prompt_completion"],
    "prompt_key": ["instruction", "conversation.prompt"],
    "chat_template": ["gs://my-bucket/templates/chatml.jinja"],
}
# Values every regex of the parameter must reject.
BAD = {
    "input": ["/local/path/*.jsonl", "gs://", "gs://Bad Bucket/x"],
    "output": ["/local/cache", "s3://bucket/x", "gs://b/with space"],
    "tokenizer": ["tiktoken:", "two words"],
    "text_key": ["", "has space"],
    "append_eos": ["yes please", "True1"],
    "chunk_bytes": ["0", "-1", "64 MiB", "lots"],
    "row_group_tokens": ["0", "-5", "1e6"],
    "parquet_compression": ["zip", ""],
    "compression_level": ["high", ""],
    "max_bad_fraction": ["2", "-0.1", "ten percent"],
    "validation_fraction": ["1", "1.0", "-0.1", "5%"],
    "split_seed": ["-1", "seven", ""],
    "keep_fields": ["source, url", "a,,b", ","],
    "record_format": ["messages", ""],
    "chat_template": ["/local/template.jinja", "gs://", "gs://b/with space.jinja"],
}


def load_metadata() -> dict:
    return json.loads((TEMPLATES / "metadata.json").read_text())


def parser_options() -> dict[str, argparse.Action]:
    """Long option name without dashes -> action, for every option of the pipeline parser (not --help)."""
    out = {}
    for action in build_cache.build_arg_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for opt in action.option_strings:
            if opt.startswith("--"):
                out[opt[2:]] = action
    return out


def params() -> dict[str, dict]:
    return {p["name"]: p for p in load_metadata()["parameters"]}


def parse_template_args(pairs: dict[str, str]) -> argparse.Namespace:
    """Parse parameters the way the Flex Template launcher passes them (``--name=value``)."""
    argv = [f"--{k}={v}" for k, v in pairs.items()]
    args, rest = build_cache.build_arg_parser().parse_known_args(template_main.template_argv(
        argv, build_cache.build_arg_parser()))
    assert rest == [], f"not consumed by the pipeline parser: {rest}"
    return args


# ----------------------------------------------------------------------------------------------------
# metadata.json <-> the pipeline's options


def test_every_parameter_is_a_flag_and_every_flag_is_a_parameter():
    opts, meta = parser_options(), params()
    assert sorted(meta) == sorted(set(meta)), "duplicate parameter names in metadata.json"
    missing = sorted(set(opts) - set(meta))
    unknown = sorted(set(meta) - set(opts))
    assert not unknown, f"templates/metadata.json declares parameters the pipeline has no flag for: {unknown}"
    assert not missing, (f"pipeline options without a template parameter: {missing}; "
                         "add them to templates/metadata.json")


def test_required_flags_are_required_parameters():
    opts, meta = parser_options(), params()
    for name, action in opts.items():
        assert meta[name]["isOptional"] is (not action.required), (
            f"{name}: isOptional={meta[name]['isOptional']} but the parser has required={action.required}")
    assert {n for n, a in opts.items() if a.required} >= {"input", "output", "tokenizer"}


def test_every_parameter_is_documented():
    for p in params().values():
        assert p["label"].strip() and len(p["helpText"].strip()) > 20, p["name"]
        assert p.get("regexes"), f"{p['name']}: no regex (every parameter of this template has one that fits)"


def test_regexes_compile_accept_defaults_and_examples_and_reject_bad_values():
    opts = parser_options()
    for name, p in params().items():
        regexes = [re.compile(r) for r in p["regexes"]]
        good = list(EXAMPLES.get(name, []))
        if p["isOptional"]:
            good.append(p["defaultValue"])
        assert good, f"{name}: nothing to check its regexes against; add an example"
        for value in good:
            for r in regexes:
                assert r.fullmatch(value), f"{name}: regex {r.pattern!r} rejects the valid value {value!r}"
        for value in BAD.get(name, []):
            assert not all(r.fullmatch(value) for r in regexes), f"{name}: regexes accept the bad value {value!r}"
        if opts[name].choices:
            for choice in opts[name].choices:
                assert all(r.fullmatch(str(choice)) for r in regexes), (name, choice)


def test_default_values_are_the_parser_defaults():
    opts = parser_options()
    optional = {n: p for n, p in params().items() if p["isOptional"]}
    parsed = parse_template_args({"input": "gs://b/x.jsonl", "output": "gs://b/c", "tokenizer": "tiktoken:cl100k_base",
                                  **{n: p["defaultValue"] for n, p in optional.items()}})
    for name in optional:
        dest = opts[name].dest
        assert getattr(parsed, dest) == opts[name].default, (
            f"{name}: metadata defaultValue {optional[name]['defaultValue']!r} parses to "
            f"{getattr(parsed, dest)!r}, the parser's default is {opts[name].default!r}")


def test_every_example_value_parses_as_the_launcher_passes_it():
    for name, values in EXAMPLES.items():
        for v in values:
            base = {"input": "gs://b/x.jsonl", "output": "gs://b/c", "tokenizer": "tiktoken:cl100k_base"}
            parse_template_args({**base, name: v})


def test_enum_options_are_the_parser_choices():
    opts = parser_options()
    for name, p in params().items():
        if opts[name].choices:
            assert p["paramType"] == "ENUM", name
            assert sorted(o["value"] for o in p["enumOptions"]) == sorted(opts[name].choices), name
        else:
            assert "enumOptions" not in p, name


def test_boolean_switches_take_true_and_false():
    opts = parser_options()
    switches = [n for n, a in opts.items() if isinstance(a, argparse._StoreTrueAction)]
    assert "append_eos" in switches
    base = {"input": "gs://b/x.jsonl", "output": "gs://b/c", "tokenizer": "tiktoken:cl100k_base"}
    for name in switches:
        assert params()[name]["paramType"] == "BOOLEAN"
        assert getattr(parse_template_args({**base, name: "true"}), opts[name].dest) is True
        assert getattr(parse_template_args({**base, name: "false"}), opts[name].dest) is False
        assert getattr(parse_template_args(base), opts[name].dest) is False
    with pytest.raises(SystemExit, match="append_eos takes true or false"):
        template_main.template_argv(["--append_eos=maybe"], build_cache.build_arg_parser())
    # Beam options and values that merely contain '=' pass through untouched.
    argv = ["--runner=DataflowRunner", "--text_key=a=b", "--append_eos"]
    assert template_main.template_argv(argv, build_cache.build_arg_parser()) == argv


def test_metadata_is_a_valid_dataflow_template_metadata():
    types = pytest.importorskip("google.cloud.dataflow_v1beta3.types",
                                reason="apache-beam[gcp] (google-cloud-dataflow-client) is not installed")
    meta = load_metadata()
    parsed = types.TemplateMetadata.from_json(json.dumps(meta), ignore_unknown_fields=False)
    assert [p.name for p in parsed.parameters] == [p["name"] for p in meta["parameters"]]
    assert parsed.streaming is False
    for p in parsed.parameters:
        assert p.param_type != types.ParameterType.DEFAULT, f"{p.name}: give it a paramType"


@pytest.mark.skipif(shutil.which("gcloud") is None, reason="gcloud is not installed (optional offline check)")
def test_gcloud_accepts_the_metadata_file(tmp_path):
    env = dict(os.environ, CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), CLOUDSDK_CORE_DISABLE_PROMPTS="1")
    proc = subprocess.run(
        ["gcloud", "dataflow", "flex-template", "build", "gs://b/templates/t.json", "--project=my-project",
         "--image=us-docker.pkg.dev/my-project/r/i:1", "--sdk-language=PYTHON",
         f"--metadata-file={TEMPLATES / 'metadata.json'}", "--print-only", "--format=json"],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    if isinstance(spec, str):  # gcloud prints the spec as a JSON string
        spec = json.loads(spec)
    assert spec["image"] == "us-docker.pkg.dev/my-project/r/i:1"
    assert spec["sdkInfo"]["language"] == "PYTHON"
    assert [p["name"] for p in spec["metadata"]["parameters"]] == list(params())


def test_template_main_help_lists_every_parameter():
    proc = subprocess.run([sys.executable, str(TEMPLATES / "main.py"), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for name in params():
        assert f"--{name}" in proc.stdout, name


# ----------------------------------------------------------------------------------------------------
# Dockerfile and requirements: pinned, and pinned to what the tests run with


def dockerfile_args() -> tuple[dict[str, str], list[str], str]:
    text = (TEMPLATES / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", "\n".join(lines), re.M))
    return args, lines, text


def test_dockerfile_bases_are_pinned_python311_and_beam_matches():
    args, lines, _ = dockerfile_args()
    froms = [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    assert len(froms) == 2, froms
    resolved = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], f) for f in froms]
    launcher, sdk = resolved
    assert launcher.startswith("gcr.io/dataflow-templates-base/python311-template-launcher-base")
    assert sdk.startswith("apache/beam_python3.11_sdk:")
    for image in resolved:
        name, _, tag = image.partition("@")[0].rpartition(":")
        pinned = "@sha256:" in image or (tag and tag != "latest" and "/" not in tag)
        assert pinned, f"{image}: pin a tag or digest, not latest"
    import apache_beam

    assert sdk == f"apache/beam_python3.11_sdk:{apache_beam.__version__}", (
        f"Dockerfile SDK image {sdk} differs from the Beam the tests run ({apache_beam.__version__})")
    assert sys.version_info[:2] == (3, 11)


def test_dockerfile_serves_as_launcher_and_worker_image():
    args, lines, text = dockerfile_args()
    assert any(ln.startswith("COPY --from=launcher /opt/google/dataflow/python_template_launcher") for ln in lines)
    env = dict(re.findall(r'^ENV (\w+)="?([^"\s]+)"?$', "\n".join(lines), re.M))
    py_file = env["FLEX_TEMPLATE_PYTHON_PY_FILE"].replace("${WORKDIR}", args["WORKDIR"])
    copies = [ln.split()[1:] for ln in lines if ln.startswith("COPY ") and "--from" not in ln]
    dests = {c[-1].replace("${WORKDIR}", args["WORKDIR"]): c[:-1] for c in copies}
    assert dests.get(py_file) == ["templates/main.py"], (py_file, dests)
    for srcs in dests.values():
        for src in srcs:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist (build context = repo root)"
    assert lines[-1] == 'ENTRYPOINT ["/opt/apache/beam/boot"]', "the SDK worker entry point must stay last"
    assert "FLEX_TEMPLATE_PYTHON_REQUIREMENTS_FILE" not in env, "deps are baked in; do not reinstall at launch"
    ignore = (TEMPLATES / ".gcloudignore").read_text().split()
    for srcs in dests.values():
        for src in srcs:
            top = src.split("/")[0]
            assert f"!{top}" in ignore or f"!{top}/" in ignore, f".gcloudignore would not upload {src}"


def requirement_pins(path: Path = TEMPLATES / "requirements.txt") -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[\w,]+\])?==([\w.+]+)", line)
        assert m, f"{path.name}: {line!r} is not pinned as name==version"
        pins[m.group(1).lower().replace("_", "-")] = m.group(3)
    return pins


def test_requirements_are_the_locked_versions():
    """The image installs what the tests run: every pin equals requirements.lock's (never PyPI's newest)."""
    pins, lock = requirement_pins(), requirement_pins(ROOT / "requirements.lock")
    args, _, _ = dockerfile_args()
    assert pins["apache-beam"] == args["BEAM_VERSION"]
    differ = {n: (v, lock.get(n)) for n, v in pins.items() if lock.get(n) != v}
    assert not differ, (f"templates/requirements.txt differs from requirements.lock (image pin, lock pin): {differ}; "
                        "regenerate both with `make lock`")


def test_requirements_cover_the_runtime_dependencies():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    deps = list(meta["dependencies"]) + extras["pipeline"] + extras["hf"] + extras["gcs"]
    names = {re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    missing = sorted(names - set(requirement_pins()))
    assert not missing, f"templates/requirements.txt lacks runtime dependencies of pyproject.toml: {missing}"


# ----------------------------------------------------------------------------------------------------
# The Makefile: prints the commands, RUN=1 runs exactly those


def make_print(*extra: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(TEMPLATES), "print", *extra], capture_output=True, text=True,
                          timeout=60, env=env)


def gcloud_commands(stdout: str) -> list[list[str]]:
    return [shlex.split(ln) for ln in stdout.splitlines() if ln.startswith("gcloud ")]


def flag(cmd: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in cmd if a.startswith(f"--{name}=")]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_template_prints_build_and_run_commands():
    proc = make_print("PROJECT=my-project", "REGION=europe-west4", "BUCKET=my-bucket", "TAG=t1",
                      "INPUT=gs://my-bucket/corpus/*.jsonl.gz")
    assert proc.returncode == 0, proc.stderr
    cmds = gcloud_commands(proc.stdout)
    assert [c[:3] for c in cmds] == [["gcloud", "builds", "submit"], ["gcloud", "dataflow", "flex-template"],
                                     ["gcloud", "dataflow", "flex-template"]]
    image_cmd, build, run = cmds
    assert build[3] == "build" and run[3] == "run"
    image = "europe-west4-docker.pkg.dev/my-project/chunkledger/chunkledger-build-cache:t1"
    assert flag(image_cmd, "substitutions") == [f"_IMAGE={image}"]
    assert Path(flag(image_cmd, "config")[0]) == TEMPLATES / "cloudbuild.yaml"
    assert build[4] == "gs://my-bucket/templates/chunkledger-build-cache.json"
    assert flag(build, "image") == [image] and flag(build, "sdk-language") == ["PYTHON"]
    assert Path(flag(build, "metadata-file")[0]) == TEMPLATES / "metadata.json"
    assert flag(run, "template-file-gcs-location") == [build[4]]
    assert flag(run, "region") == ["europe-west4"] and flag(run, "project") == ["my-project"]
    assert flag(run, "temp-location")[0].startswith("gs://my-bucket/")
    given = dict(p.split("=", 1) for p in flag(run, "parameters"))
    assert given.pop("sdk_container_image") == image, "workers must run the template image"
    meta = params()
    assert set(given) <= set(meta)
    assert {n for n, p in meta.items() if not p["isOptional"]} <= set(given)
    for name, value in given.items():
        for r in meta[name]["regexes"]:
            assert re.fullmatch(r, value), f"the Makefile's {name}={value!r} fails its own regex {r!r}"
    assert given["input"] == "gs://my-bucket/corpus/*.jsonl.gz"
    assert "printed only" in proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_template_run_executes_exactly_the_printed_commands(tmp_path):
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    common = ["PROJECT=my-project", "REGION=us-central1", "BUCKET=my-bucket", "TAG=t2", "JOB=chunkledger-test"]
    printed = make_print(*common, env=env)
    ran = make_print(*common, "RUN=1", env=env)
    assert ran.returncode == 0, ran.stderr
    calls = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [["gcloud", *c] for c in calls] == gcloud_commands(printed.stdout)

    log.unlink()
    refused = make_print("REGION=us-central1", "BUCKET=my-bucket", "RUN=1", env=env)
    assert refused.returncode != 0 and "PROJECT" in refused.stderr
    assert not log.exists(), "RUN=1 without PROJECT must not call gcloud"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_top_level_make_template_delegates_to_templates():
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "template", "PROJECT=p-1", "REGION=us-east1",
                           "BUCKET=b-1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmds = gcloud_commands(proc.stdout)
    assert len(cmds) == 3 and flag(cmds[2], "project") == ["p-1"] and flag(cmds[2], "region") == ["us-east1"]


# ----------------------------------------------------------------------------------------------------
# The launcher's view: templates/main.py describing a Dataflow job (as the Flex Template launcher does)


def test_template_main_describes_a_dataflow_job_without_running_it(tmp_path, capsys):
    pytest.importorskip("google.cloud.dataflow_v1beta3", reason="apache-beam[gcp] is not installed")
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (test extra) is not installed")
    from gcs_emulator import GcsEmulator

    image = "europe-west4-docker.pkg.dev/chunkledger-test/chunkledger/chunkledger-build-cache:t1"
    job_file = tmp_path / "job.json"
    with GcsEmulator(bucket="chunkledger-tpl") as emu:
        emu.upload(ROOT / "pipelines" / "sample_corpus" / "part-03.jsonl.gz", "corpus/part-03.jsonl.gz")
        # What the launcher passes: template parameters as --name=value, then the job's Beam options.
        argv = [f"--input={emu.url('corpus/*.jsonl.gz')}", f"--output={emu.url('cache')}",
                "--tokenizer=tiktoken:cl100k_base", "--append_eos=true", "--chunk_bytes=16KiB",
                "--runner=DataflowRunner", "--project=chunkledger-test", "--region=europe-west4",
                f"--temp_location={emu.url('tmp')}", f"--sdk_container_image={image}", "--sdk_location=container",
                "--job_name=chunkledger-tpl", f"--template_location={job_file}"]
        with emu.beam_env():
            template_main.main(argv)  # no SystemExit: describing the job is the launcher's whole job
        plan = json.loads(emu.gcsfs().cat_file(f"{emu.bucket}/cache/ledger.json"))
    assert "job description written, nothing ran" in capsys.readouterr().out
    assert plan["finished"] is False and plan["config"]["append_eos"] is True
    assert plan["config"]["chunk_bytes"] == 16 << 10
    job = json.loads(job_file.read_text())
    assert job["environment"]["workerPools"][0]["sdkHarnessContainerImages"][0]["containerImage"] == image

    with pytest.raises(SystemExit) as e:  # a real error still fails the launch
        template_main.main(["--input=/nonexistent/*.jsonl", "--output=/tmp/x", "--tokenizer=tiktoken:cl100k_base",
                            "--runner=DataflowRunner", "--dry_run=True"])
    assert e.value.code == 2
