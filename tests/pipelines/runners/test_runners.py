"""The same pipeline on the scale-out runners: portable (the stand-in for Flink), Flink (opt-in) and Dataflow.

* PortableRunner against a local job service (``local_job_service_main`` in a subprocess on 127.0.0.1),
  with the SDK harness in this process (LOOPBACK) and in a separate worker pool (EXTERNAL,
  ``worker_pool_main`` in a subprocess): the cache is byte-identical to the in-process FnApiRunner's.
* FlinkRunner: opt-in, when ``CHUNKLEDGER_FLINK_JOB_SERVER_JAR`` (a Beam Flink job-server jar) and
  ``CHUNKLEDGER_FLINK_MASTER`` (``host:port`` of the Flink REST endpoint, or ``[local]``) are set.
  Optional: ``CHUNKLEDGER_FLINK_VERSION`` (e.g. 1.19), ``CHUNKLEDGER_FLINK_ENVIRONMENT`` (Beam environment
  flags, default ``--environment_type=LOOPBACK``; a remote cluster needs e.g. ``--environment_type=DOCKER``).
* DataflowRunner: Beam writes the complete Dataflow job description without submitting it
  (``--template_location=FILE``); staging goes to a local Cloud Storage emulator, so this runs offline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest

from build_helpers import tree_bytes, write_shard
from pipelines import build_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SAMPLE = os.path.join(REPO, "pipelines", "sample_corpus")
CHUNK = 40000
pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service(args: list[str], port: int, what: str, timeout: float = 90.0):
    """Run ``python -m <args>`` until it listens on 127.0.0.1:port; always stop it afterwards."""
    # The worker pool starts SDK workers with a bare `python`: make that this interpreter.
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.time() > deadline:
                raise RuntimeError(f"{what} did not listen on port {port} within {timeout:.0f}s")
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)  # the worker pool's SDK workers are in its process group
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=20)
        proc.stderr.close()
        assert proc.poll() is not None, f"{what} still running"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The sample corpus (3 plain shards + 1 gzip) and a zstd shard holding malformed lines."""
    d = tmp_path_factory.mktemp("runners_corpus")
    for name in sorted(os.listdir(SAMPLE)):
        (d / name).write_bytes(open(os.path.join(SAMPLE, name), "rb").read())
    good = [{"text": f"document {i}: " + "tokens and more tokens " * (i % 17)} for i in range(120)]
    bad = ["{broken json", "[1, 2]", '{"text": 5}', '{"other": "x"}', '{"text": ""}']
    write_shard(str(d / "part-04.jsonl.zst"), good[:50] + bad + good[50:])
    return d


def argv(corpus, out: str) -> list[str]:
    return ["--input", str(corpus / "*"), "--output", out, "--tokenizer", "tiktoken:cl100k_base", "--append_eos",
            "--chunk_bytes", str(CHUNK), "--row_group_tokens", "3000", "--max_bad_fraction", "0.1"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runners_ref") / "cache")
    res = build_cache.run(argv(corpus, out) + ["--runner=FnApiRunner"])
    files = tree_bytes(out)
    assert res["ledger"]["totals"]["bad_records"] == 5 and any(k.startswith("bad/") for k in files)
    assert res["ledger"]["totals"]["chunks"] > 12
    return files


def assert_identical(out: str, reference: dict[str, bytes]) -> None:
    got = tree_bytes(out)
    assert sorted(got) == sorted(reference)
    for k in reference:
        assert got[k] == reference[k], f"{out}: {k} differs from the FnApiRunner build"


@pytest.fixture(scope="module")
def job_endpoint():
    port = free_port()
    with service(["apache_beam.runners.portability.local_job_service_main", f"--port={port}"], port,
                 "local job service"):
        yield f"localhost:{port}"


@pytest.mark.slow
def test_portable_loopback_is_byte_identical(corpus, reference, job_endpoint, tmp_path):
    out = str(tmp_path / "cache")
    build_cache.run(argv(corpus, out) + ["--runner=PortableRunner", f"--job_endpoint={job_endpoint}",
                                         "--environment_type=LOOPBACK"])
    assert_identical(out, reference)


@pytest.mark.slow
def test_portable_external_worker_pool_is_byte_identical(corpus, reference, job_endpoint, tmp_path):
    port = free_port()
    with service(["apache_beam.runners.worker.worker_pool_main", f"--service_port={port}"], port,
                 "SDK worker pool"):
        out = str(tmp_path / "cache")
        build_cache.run(argv(corpus, out) + [
            "--runner=PortableRunner", f"--job_endpoint={job_endpoint}", "--environment_type=EXTERNAL",
            f"--environment_config=localhost:{port}"])
    assert_identical(out, reference)


FLINK_JAR = os.environ.get("CHUNKLEDGER_FLINK_JOB_SERVER_JAR")
FLINK_MASTER = os.environ.get("CHUNKLEDGER_FLINK_MASTER")


@pytest.mark.flink
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not (FLINK_JAR and FLINK_MASTER),
                    reason="opt-in: set CHUNKLEDGER_FLINK_JOB_SERVER_JAR=/path/beam-runners-flink-<v>-job-server-"
                           "<beam>.jar and CHUNKLEDGER_FLINK_MASTER=host:port (or [local]) to run on Flink")
def test_flink_is_byte_identical(corpus, reference, tmp_path):
    out = os.environ.get("CHUNKLEDGER_FLINK_OUTPUT_DIR") or str(tmp_path / "cache")
    flags = ["--runner=FlinkRunner", f"--flink_master={FLINK_MASTER}", f"--flink_job_server_jar={FLINK_JAR}"]
    if os.environ.get("CHUNKLEDGER_FLINK_VERSION"):
        flags.append(f"--flink_version={os.environ['CHUNKLEDGER_FLINK_VERSION']}")
    flags += shlex.split(os.environ.get("CHUNKLEDGER_FLINK_ENVIRONMENT", "--environment_type=LOOPBACK"))
    flags.append("--parallelism=2")
    build_cache.run(argv(corpus, out) + flags)
    assert_identical(out, reference)


# ------------------------------------------------------------------------------------------------------
# Dataflow: the job description, built offline


@pytest.mark.slow
def test_dataflow_job_description_offline(corpus, tmp_path):
    pytest.importorskip("google.cloud.dataflow_v1beta3", reason="apache-beam[gcp] is not installed")
    pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (test extra) is not installed")
    from apache_beam.portability.api import beam_runner_api_pb2

    from gcs_emulator import GcsEmulator

    image = "us-central1-docker.pkg.dev/chunkledger-test/chunkledger/chunkledger-build-cache:abc123"
    job_file = tmp_path / "job.json"
    with GcsEmulator(bucket="chunkledger-df") as emu:
        for name in sorted(os.listdir(corpus)):
            emu.upload(corpus / name, "corpus/" + name)
        args = ["--input", emu.url("corpus/*"), "--output", emu.url("cache"), "--tokenizer", "tiktoken:cl100k_base",
                "--chunk_bytes", str(CHUNK),
                "--runner=DataflowRunner", "--project=chunkledger-test", "--region=us-central1",
                f"--temp_location={emu.url('tmp')}", f"--staging_location={emu.url('staging')}",
                f"--sdk_container_image={image}", "--sdk_location=container", "--job_name=chunkledger-offline",
                "--max_num_workers=7", f"--template_location={job_file}"]
        with emu.beam_env():
            # Writing a job description is not a build: the launcher plans (ledger.json, finished=false),
            # Beam translates and stages the pipeline and writes the job file, and nothing runs.
            res = build_cache.run(args)
        assert res["submitted"] is False and res["ledger"]["finished"] is False
        plan = json.loads(emu.gcsfs().cat_file(f"{emu.bucket}/cache/ledger.json"))
        staged = {p.rsplit("/", 1)[-1]: p for p in emu.gcsfs().find(f"{emu.bucket}/staging")}
        assert "pipeline.pb" in staged, sorted(staged)
        proto = beam_runner_api_pb2.Pipeline.FromString(emu.gcsfs().cat_file(staged["pipeline.pb"]))

    assert plan["finished"] is False and len(plan["inputs"]) == 5
    assert all(i["path"].startswith("gs://chunkledger-df/corpus/") for i in plan["inputs"])

    job = json.loads(job_file.read_text())
    assert job["name"] == "chunkledger-offline" and job["type"] == "JOB_TYPE_BATCH"
    env = job["environment"]
    assert "use_runner_v2" in env["experiments"]
    pool = env["workerPools"][0]
    assert pool["workerHarnessContainerImage"] == image
    assert [c["containerImage"] for c in pool["sdkHarnessContainerImages"]] == [image]
    opts = env["sdkPipelineOptions"]["options"]
    assert opts["project"] == "chunkledger-test" and opts["region"] == "us-central1"
    assert opts["temp_location"].startswith("gs://chunkledger-df/tmp/") and opts["max_num_workers"] == 7

    # The staged pipeline holds the builder's transforms, all in the one Docker environment of the image.
    names = {t.unique_name for t in proto.components.transforms.values()}
    for step in ("BuildCache/PlanUnits", "BuildCache/Spread", "BuildCache/BuildChunks", "BuildCache/Finalize"):
        assert any(n == step or n.startswith(step + "/") for n in names), (step, sorted(names))
    images = set()
    for e in proto.components.environments.values():
        assert e.urn == "beam:env:docker:v1", e.urn
        images.add(beam_runner_api_pb2.DockerPayload.FromString(e.payload).container_image)
    assert images == {image}
