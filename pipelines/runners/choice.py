"""Which Beam runner a build runs on: the local default, and short names for runners Beam spells long.

No ``--runner``: the multi-process DirectRunner, one worker per CPU. ``--runner=DaskRunner``: Beam's Dask
runner on a Dask cluster, whose scheduler is checked before anything is written (docs/RUNNING.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from typing import Any

from reader.storage import files

from pipelines.errors import BuildError

LOG = logging.getLogger("chunkledger.build")

DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
DASK_CONNECT_SECONDS = 10


async def dask_identity(address: str) -> dict[str, Any]:
    """What the Dask server at ``address`` says it is (one request; no Client, no threads left behind)."""
    import asyncio

    from distributed.core import rpc

    async with rpc(address, timeout=DASK_CONNECT_SECONDS) as server:
        return await asyncio.wait_for(server.identity(), DASK_CONNECT_SECONDS)


def runner_args(pipeline_args: list[str]) -> list[str]:
    """The Beam arguments to run with: our defaults and short runner names added (a later flag wins in Beam).

    No ``--runner``: the multi-process DirectRunner, one worker per CPU. ``--runner=DaskRunner`` (Beam has
    no short name for it): Beam's Dask runner on the scheduler at ``--dask_client_address`` (or
    ``--dask_scheduler_file``), checked reachable now so a wrong address fails in seconds with its name,
    and one Dask task per work unit unless ``--dask_npartitions``/``--dask_partition_size`` say otherwise
    (Beam's default of 128 elements per partition runs a build of fewer units as one task on one worker).

    Args:
        pipeline_args: the command line's options that are not the builder's own.
    """
    if not any(a == "--runner" or a.startswith("--runner=") for a in pipeline_args):
        def given(name: str) -> bool:
            return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in pipeline_args)

        # only what the command line leaves out (Beam takes the last of repeated flags)
        defaults = ["--runner=DirectRunner"]
        if not given("direct_running_mode"):
            defaults.append("--direct_running_mode=multi_processing")
        if not given("direct_num_workers"):
            defaults.append(f"--direct_num_workers={os.cpu_count() or 1}")
        return pipeline_args + defaults
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("runner", "dask_client_address", "dask_scheduler_file", "dask_connection_timeout",
                 "dask_npartitions", "dask_partition_size"):
        p.add_argument(f"--{name}")
    a, _ = p.parse_known_args(pipeline_args)
    if a.runner.lower() not in ("dask", "daskrunner", DASK_RUNNER.lower()):
        return pipeline_args
    address, where = a.dask_client_address, f"--dask_client_address={a.dask_client_address}"
    if not address and a.dask_scheduler_file:
        try:
            address = json.loads(files.read_local(a.dask_scheduler_file, limit=files.MAX_SMALL_FILE_BYTES))["address"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BuildError(f"--dask_scheduler_file={a.dask_scheduler_file}: cannot read the scheduler's address "
                             f"({type(e).__name__}: {e}); give the file `dask scheduler --scheduler-file` wrote, "
                             "on a file system this machine sees") from e
        where = f"--dask_scheduler_file={a.dask_scheduler_file} (scheduler {address})"
    if not address:
        raise BuildError("--runner=DaskRunner needs the Dask scheduler to run on: --dask_client_address=HOST:PORT "
                         "(start one with `dask scheduler` and workers with `dask worker tcp://HOST:PORT`; "
                         "see docs/RUNNING.md) or --dask_scheduler_file=FILE")
    unreachable = (f"{where}: no Dask scheduler answers there ({{}}). Start one (`dask scheduler`, then "
                   "`dask worker tcp://HOST:PORT` on each machine) or fix the address; nothing was written")
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    import asyncio  # here: the launcher imports this module before Beam, to decide on local workers

    try:  # a refused port or unknown host fails at once, without Dask's connection retries
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=DASK_CONNECT_SECONDS).close()
        info = asyncio.run(dask_identity(address))
    except ImportError as e:
        raise BuildError(f"--runner=DaskRunner needs Dask: pip install 'chunkledger[dask]' ({e})") from e
    except Exception as e:  # noqa: BLE001 - whatever the other end is, it is not a usable scheduler
        raise BuildError(unreachable.format(f"{type(e).__name__}: {e}")) from e
    if info.get("type") != "Scheduler":
        raise BuildError(unreachable.format(f"a Dask {info.get('type')} answers, not a scheduler"))
    workers = len(info.get("workers") or {})
    if not workers:
        LOG.warning("the Dask scheduler at %s has no workers yet: the build waits until some join "
                    "(`dask worker %s`, or your cluster's autoscaler)", address, address)
    extra = [f"--runner={DASK_RUNNER}"]
    if a.dask_connection_timeout is None:  # Dask's default is 30 s, per connection attempt
        extra.append(f"--dask_connection_timeout={DASK_CONNECT_SECONDS}")
    if a.dask_npartitions is None and a.dask_partition_size is None:
        extra.append("--dask_partition_size=1")
    return pipeline_args + extra


def is_local_multiprocess(runner: str | None, mode: str | None) -> bool:
    """Whether ``--runner`` and ``--direct_running_mode`` (None: not given) run Beam's multi-process
    DirectRunner, the local default: the one rule, for a command line before Beam is imported
    (``pipelines/runners/local_workers.py``) and for resolved options (:func:`local_process_workers`)."""
    if runner is None:
        return mode in (None, "multi_processing")
    return runner.lower() in ("directrunner", "direct") and mode == "multi_processing"


def local_process_workers(options) -> int:
    """The number of worker processes of Beam's multi-process DirectRunner for these (resolved) pipeline
    options, or 0 for any other runner."""
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    direct = options.view_as(DirectOptions)
    if not is_local_multiprocess(options.view_as(StandardOptions).runner, direct.direct_running_mode or "in_memory"):
        return 0
    return direct.direct_num_workers or os.cpu_count() or 1


def forked_workers_runner(worker_command: str):
    """Beam's FnApiRunner (what the DirectRunner runs for a batch pipeline) starting each SDK worker with
    ``worker_command`` (see pipelines/runners/local_workers.py) instead of a fresh ``sdk_worker_main`` process.

    ``--direct_num_workers`` and everything else keep their meaning.
    """
    from apache_beam.options.pipeline_options import DirectOptions
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.transforms.environments import SubprocessSDKEnvironment

    class ForkedWorkersRunner(FnApiRunner):
        def run_pipeline(self, pipeline, options):
            # FnApiRunner replaces the environment with Beam's worker command for "multi_processing"
            view = options.view_as(DirectOptions)
            mode, view.direct_running_mode = view.direct_running_mode, "forked_workers"
            try:
                return super().run_pipeline(pipeline, options)
            finally:
                view.direct_running_mode = mode

    return ForkedWorkersRunner(default_environment=SubprocessSDKEnvironment.from_command_string(worker_command))
