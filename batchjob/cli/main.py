"""The `batchjob` command line: `run` (its flags: run_options.py), `status`, `export`, `show`, `verify`,
`slurm submit`, `ray submit` and `bench`; an expected error is one line on stderr and an exit code."""
from __future__ import annotations

import os
import sys

import click

from batchjob.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_RESUMABLE, EXIT_USAGE, ConfigError
from batchjob.job.options.config import SECTIONS, load_job
from batchjob.job.process.failures import job_failures
from batchjob.job.process.threads import choose_wait_policy
from batchjob.ray.runners import Runner
from batchjob.cli.run_options import run_options


@click.group()
@click.version_option(package_name="batchjob")
def main() -> None:
    """batchjob: offline batch LLM inference with checkpoint-resume."""


RUN_HELP = (
    "Run JOB (a TOML file whose keys are the option names below, with underscores, at the top level or in the "
    f"optional tables {', '.join(f'[{t}]' for t in SECTIONS)}: docs/reference/run-options.md says which key goes "
    "where). Flags override the file. Re-running the same command on an output folder with committed parts "
    "continues where it stopped. Exit codes: 0 done, 1 failed (also on a rerun of a failed job), 2 a bad flag or "
    "job file, 75 stopped by a signal (rerun to continue), 130 stopped at once (a second Ctrl-C, or Ctrl-C during "
    "start-up).")


@main.command("run", help=RUN_HELP)
@click.option("--restart", is_flag=True, help="delete the output folder's committed results (parts, manifest, stats) "
              "and start over, e.g. after changing the input, model or parameters")
@run_options
def run_cmd(job: str | None, restart: bool, **overrides) -> None:
    """`batchjob run` (RUN_HELP)."""
    started = False
    choose_wait_policy()  # before torch is imported: OpenMP reads it once (job/process/threads.py)
    try:  # the imports too: torch's takes seconds, and a Ctrl-C there is a start-up interrupted
        from batchjob.job.process.preflight import preflight

        try:
            cfg = load_job(job, overrides)
        except ConfigError as e:
            _fail(e, EXIT_USAGE)
        from batchjob.launch.local import wants_ranks

        if wants_ranks(cfg.data_parallel):
            _run_data_parallel(job, overrides, cfg, restart)
            return
        try:  # before torch is imported: what needs no model is said in a second (job/process/preflight.py)
            summary = preflight(cfg, restart=restart)
        except job_failures(with_torch=False) as e:
            _fail(e, EXIT_FAILED)
        if summary is not None:
            click.echo(summary.line())
            return
        import contextlib

        from batchjob.job.run import Job

        with contextlib.ExitStack() as held:  # the output lock goes back however the job ends
            running = Job(cfg, restart=restart, resources=held)
            started = True
            summary = running.run()
    except KeyboardInterrupt:
        _ignore_sigint()
        if not started:
            click.echo("batchjob: interrupted during start-up: nothing ran and nothing was written", err=True)
            # at once: an interrupt inside a C extension's import (torch) can leave the interpreter to re-raise
            # SIGINT at its exit (seen: the process died by the signal, -2, instead of exiting 130), and there
            # is nothing to flush or release (Job.__init__ took back its folders and lock)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        else:
            click.echo("batchjob: interrupted: stopped at once; committed rows are kept, the rows in flight run "
                       "again when you rerun the same command", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except ConfigError as e:
        _fail(e, EXIT_USAGE)
    except Exception as e:  # noqa: BLE001 - a job that cannot go on: one line; a bug: the traceback kept in a file
        if isinstance(e, job_failures()):
            _ignore_sigint()
            _fail(e, EXIT_FAILED)
        _internal_error(e, cfg.output)
    _ignore_sigint()  # the final commit is done: a Ctrl-C now changes nothing, and the exit code is the job's
    click.echo(summary.line())
    if summary.stopped:
        click.echo(f"batchjob: stopped by {summary.stopped}; everything finished is committed — rerun the same "
                   f"command to continue (`batchjob status {summary.output}` shows progress)", err=True)
        sys.exit(EXIT_RESUMABLE)


def _run_data_parallel(job: str | None, overrides: dict, cfg, restart: bool) -> None:
    """`run --data-parallel N`: N rank processes on this node's devices (launch/local.py); one summary line, the
    exit code of the whole: 0 every shard finished, 75 stopped (rerun to continue), 1 a shard failed."""
    from batchjob.launch.local import run_data_parallel

    from batchjob.job.process.failures import job_failures

    try:
        done = run_data_parallel(job, {k: v for k, v in overrides.items() if v is not None}, cfg, restart=restart,
                                 log=lambda text: click.echo(text, err=True))
    except ConfigError as e:
        _fail(e, EXIT_USAGE)
    except job_failures(with_torch=False) as e:  # an input that is not there or cannot be sharded
        _fail(e, EXIT_FAILED)
    st = done.status
    tps = st.get("completion_tokens", 0) / done.wall_s if done.wall_s else 0.0
    state = "failed" if done.failed else "stopped" if done.stopped else "finished"
    click.echo(f"batchjob: {state}: {st.get('rows_done', 0):,} of {st.get('total_rows', 0):,} rows "
               f"({st.get('errors', 0):,} errors); {len(done.placements)} ranks, {len(done.outcomes)} shards, "
               f"{st.get('prompt_tokens', 0)} prompt tokens, {st.get('completion_tokens', 0)} generated tokens in "
               f"{done.wall_s:.1f}s ({tps:.1f} tokens/s) -> {cfg.output}")
    for failed in done.failed:
        click.echo(f"batchjob: error: shard {failed.index}: {failed.error}", err=True)
    if done.failed:
        sys.exit(EXIT_FAILED)
    if done.stopped:
        click.echo(f"batchjob: stopped; everything finished is committed — rerun the same command to continue "
                   f"(`batchjob status {cfg.output}` shows progress)", err=True)
        sys.exit(EXIT_RESUMABLE)


def _ignore_sigint() -> None:
    """Past the job's end (or its failure), Ctrl-C is ignored until exit: no KeyboardInterrupt from an echo
    or from torch's exit handlers turns a finished job's exit code into 130 or a traceback."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)




def _fail(e: Exception, code: int) -> None:
    click.echo(f"batchjob: error: {e}", err=True)
    sys.exit(code)


def _internal_error(e: Exception, output: str | None) -> None:
    """An exception nobody expected: one line on stderr, the traceback in a file it names (exit 1)."""
    import os
    import tempfile
    import traceback
    from pathlib import Path

    from batchjob.io.disk import File, disk

    if os.environ.get("BATCHJOB_DEBUG"):
        raise e
    text = "".join(traceback.format_exception(e))
    folder = Path(output) if output and Path(output).is_dir() else Path(tempfile.gettempdir())
    try:
        log = folder / "batchjob-error.log"
        with File(disk(), log, append=True) as f:
            f.write(text + "\n")
        where = f"the traceback is in {log}"
    except OSError:
        where = "set BATCHJOB_DEBUG=1 to see the traceback"
    first = str(e).splitlines()[0] if str(e) else ""
    click.echo(f"batchjob: error: internal error: {type(e).__name__}: {first} ({where}; please report it)", err=True)
    sys.exit(1)


def _output_folder(out: str) -> None:
    """`status`, `export`, `show` and `verify` of a folder that is not there, or is a file: one line, exit 1."""
    from pathlib import Path

    if not Path(out).exists():
        _fail(f"{out}: no such folder; name a job's output folder (its --output)", EXIT_FAILED)
    if not Path(out).is_dir():
        _fail(f"{out} is a file; name a job's output folder (its --output)", EXIT_FAILED)


# `status` and `export` of an output folder: one folder, a folder of per-lane folders, or a sharded job's
# (OUT/job.json + OUT/shard-K-of-N/).
@main.command("status")
@click.argument("out")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def status_cmd(out: str, as_json: bool) -> None:
    """Progress of the output folder OUT: rows done / total per shard and for the whole job, whether
    each shard is running, and its Slurm task's state when squeue is available."""
    import json

    from batchjob.io.manifest import ManifestError
    from batchjob.cli.status_view import format_sharded_status, format_status
    from batchjob.sharding.sharded_output import ShardError, is_planned_or_submitted, sharded_status
    from batchjob.io.folder_status import status

    _output_folder(out)
    if not is_planned_or_submitted(out):  # one output folder (and its per-lane folders)
        try:
            progress = status(out)
        except ManifestError as e:
            click.echo(f"batchjob: error: {e}", err=True)
            sys.exit(1)
        click.echo(json.dumps(progress, indent=1) if as_json else format_status(progress))
        return
    try:  # every shard (its folder as above, its rows, its Slurm task) and the whole job
        st = sharded_status(out)
    except (ShardError, ManifestError) as e:
        click.echo(f"batchjob: error: {e}", err=True)
        sys.exit(1)
    click.echo(json.dumps(st, indent=1) if as_json else format_sharded_status(st))


@main.command("export")
@click.argument("out")
@click.option("--to", "to", required=True, type=click.Path(dir_okay=False), help="a .parquet, .jsonl or .arrow file")
@click.option("--format", "fmt", type=click.Choice(["rows", "openai-batch"]), default="rows",
              help="rows: the result rows, as the --to suffix says (default); openai-batch: OpenAI Batch response lines")
@click.option("--partial", is_flag=True, help="export the committed rows even when some input rows are missing")
def export_cmd(out: str, to: str, fmt: str = "rows", partial: bool = False) -> None:
    """Merge every committed row of OUT, in input order, into one file (written to a temporary name,
    then renamed); refuses when rows are missing and says which, unless --partial. The file's folder is
    created when missing."""
    from pathlib import Path

    from batchjob.io.disk import disk

    _output_folder(out)
    try:
        disk().mkdir(Path(to).parent)
    except OSError as e:
        in_the_way = next((p for p in Path(to).parents if p.exists() and not p.is_dir()), None)
        _fail(f"--to {to}: {in_the_way} is a file, not a folder" if in_the_way else
              f"--to {to}: cannot create its folder ({e.strerror or e}); choose a place you can write to", 1)
    if fmt == "openai-batch":  # one output folder or a sharded one
        from batchjob.io.manifest import ManifestError
        from batchjob.sharding.shards import ShardError as _ShardError
        from batchjob.io.merge import ExportError
        from batchjob.sharding.sharded_output import export_openai_batch

        try:
            files = export_openai_batch(out, to)
        except (ExportError, ManifestError, _ShardError) as e:
            click.echo(f"batchjob: error: {e}", err=True)
            sys.exit(1)
        except OSError as e:
            _export_failed(to, e)
        click.echo(f"batchjob: {files.lines} response lines -> {to}; failed requests ({files.errors}) -> {files.errors_path}")
        return
    from batchjob.sharding.sharded_output import ShardError, export_shards, has_job_file

    if not has_job_file(out):  # one output folder: a streaming merge of its parts
        from batchjob.io.export import ExportError, export

        try:
            done = export(out, to, partial=partial)
        except ExportError as e:
            click.echo(f"batchjob: error: {e}", err=True)
            sys.exit(1)
        except OSError as e:
            _export_failed(to, e)
        gap = f" ({done.missing.count()} rows missing: {done.missing.describe()})" if done.missing else ""
        click.echo(f"batchjob: {done.rows} rows -> {to}{gap}")
        if done.note:  # e.g. a --limit trial run: the export holds its first N rows
            click.echo(f"batchjob: {done.note}")
        return

    try:
        n, missing = export_shards(out, to, partial=partial)
    except ShardError as e:
        click.echo(f"batchjob: error: {e}", err=True)
        sys.exit(1)
    except OSError as e:
        _export_failed(to, e)
    gap = f" ({missing.count()} rows missing: {missing.describe()})" if missing else ""
    click.echo(f"batchjob: {n} rows -> {to}{gap}")


def _export_failed(to: str, e: OSError) -> None:
    """A disk error while exporting (a full disk, EIO, a folder that takes no files): one line, exit 1, saying
    what to do about it. The export is written under a temp name beside `to` and renamed: `to` holds the old
    file or nothing, never a half of the new (the temp name is not said: it holds nothing either)."""
    import errno
    from pathlib import Path

    beside = e.filename is not None and Path(e.filename).parent == Path(to).parent
    where = f" ({e.filename})" if e.filename and not beside else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space and run the export again"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
        fix = "choose a place you can write to with --to"
    else:
        fix = "check the disk and run the export again"
    click.echo(f"batchjob: error: cannot write {to}: {e.strerror or e}{where}; nothing was written under that name: "
               f"{fix}", err=True)
    sys.exit(1)


@main.command("show")
@click.argument("out")
@click.option("-n", "n", type=int, default=5, show_default=True, help="rows to print")
@click.option("--width", type=int, default=100, show_default=True, help="trim text to this many characters")
def show_cmd(out: str, n: int, width: int) -> None:
    """Where the results of OUT are, their schema and the first N rows in input order, each with its prompt
    (from the output, else read from the job's input). Same as `python -m batchjob.cli.show OUT`."""
    from batchjob.cli.show import show
    from batchjob.io.manifest import ManifestError

    _output_folder(out)
    try:
        text = show(out, n, width)
    except ManifestError as e:
        _fail(e, 1)
    click.echo(text)


@main.command("verify")
@click.argument("out")
@click.option("--repair", is_flag=True, help="set damaged parts aside (.corrupt) so the next run regenerates their rows")
def verify_cmd(out: str, repair: bool) -> None:
    """Read every committed part of OUT (and of its lane and shard folders) and check it against its
    SHA-256 — the full check a resume skips (it sizes every part and hashes the newest). Exit 1 when a
    part is damaged."""
    from batchjob.io.lock import LockHeld
    from batchjob.io.manifest import ManifestError
    from batchjob.io.verify import format_checks, verify

    _output_folder(out)
    try:
        checks = verify(out, repair=repair)
    except (ManifestError, LockHeld) as e:
        _fail(e, 1)
    if not checks:
        _fail(f"{out} holds no committed results (no manifest.json)", 1)
    click.echo(format_checks(checks))
    if any(c.damaged for c in checks):
        sys.exit(1)


OUTPUT_HELP = "the output folder, over the job file's `output` (as `batchjob run --output`); its shards go below it"


@main.group("slurm")
def slurm_group() -> None:
    """Run a job as a Slurm array of shards that survive preemption (docs/guide/slurm.md)."""


@slurm_group.command("submit")
@click.argument("job", type=click.Path(dir_okay=False, exists=True))
@click.option("--shards", type=click.IntRange(min=1), required=True, help="number of shards = array tasks (0..N-1)")
@click.option("--partition", help="Slurm partition")
@click.option("--gpus-per-task", type=click.IntRange(min=0), help="GPUs per array task")
@click.option("--cpus-per-task", type=click.IntRange(min=1), help="CPUs per array task (also sets OMP_NUM_THREADS)")
@click.option("--time", "time_limit", help="time limit per task, e.g. 4:00:00; the task is warned --grace seconds before")
@click.option("--mem", help="memory per task, e.g. 16G")
@click.option("--account", help="Slurm account to charge")
@click.option("--job-name", help="Slurm job name (default: batchjob-<job file name>)")
@click.option("--grace", type=int, default=120, show_default=True,
              help="seconds before the time limit at which Slurm sends USR1: batchjob drains, commits, requeues")
@click.option("--sbatch-option", "sbatch_options", multiple=True, help="another #SBATCH option, e.g. --qos=low (repeatable)")
@click.option("--dry-run", is_flag=True, help="print the sbatch script; write and submit nothing")
@click.option("--output", help=OUTPUT_HELP)
def slurm_submit_cmd(job: str, shards: int, time_limit: str | None, dry_run: bool, sbatch_options: tuple,
                     output: str | None, **options) -> None:
    """Submit JOB as an array of SHARDS tasks, each running `batchjob run JOB --shard K/SHARDS`. Writes
    OUTPUT/slurm/batchjob.sbatch (task logs in OUTPUT/slurm/logs/), submits it with sbatch and prints
    the job id."""
    from pathlib import Path

    from batchjob.sharding.slurm import SlurmError, SubmitOptions, SubmittedJob, submit

    opts = SubmitOptions(shards=shards, time=time_limit, sbatch_options=list(sbatch_options), **options)
    try:
        cfg = load_job(job, {"output": output})
        facts = SubmittedJob(Path(job), cfg.input, cfg.output, cfg.drain_timeout, bool(cfg.per_lane_inputs))
        text, job_id, out, warnings = submit(facts, opts, dry_run=dry_run)
    except (ConfigError, SlurmError) as e:
        click.echo(f"batchjob: error: {e}", err=True)
        sys.exit(1)
    for warning in warnings:
        click.echo(f"batchjob: warning: {warning}", err=True)
    if dry_run:
        click.echo(text, nl=False)
        return
    click.echo(f"batchjob: submitted {job} as Slurm job {job_id}: {shards} shards -> {out} "
               f"(script {out}/slurm/batchjob.sbatch, logs {out}/slurm/logs/{job_id}_K.log; "
               f"`batchjob status {out}`)", err=True)
    click.echo(job_id)


@main.group("ray")
def ray_group() -> None:
    """Run a job's shards on a Ray cluster, exactly once (docs/guide/ray.md)."""


@ray_group.command("submit")
@click.argument("job", type=click.Path(dir_okay=False, exists=True))
@click.option("--shards", type=click.IntRange(min=1), help="number of shards (default: four per GPU, or per shard slot "
              "of the cluster's CPUs; a rerun keeps the count its output planned)")
@click.option("--address", help="a running cluster as ray.init takes it (auto, ray://HOST:10001, HOST:6379); default: "
              "a local Ray started for the job")
@click.option("--cpus-per-shard", type=click.IntRange(min=1), default=1, show_default=True,
              help="CPUs a shard task reserves (its torch threads)")
@click.option("--gpus-per-shard", type=click.FloatRange(min=0), default=0, show_default=True,
              help="GPUs a shard task reserves")
@click.option("--max-retries", type=click.IntRange(min=0), default=3, show_default=True,
              help="times a shard is retried after its worker, node or run fails; it resumes from its last commit")
@click.option("--runner", type=click.Choice([r.value for r in Runner]), default=Runner.ACTORS.value, show_default=True,
              help="actors: a long-lived Ray actor per shard slot runs shard after shard, its model loaded once; "
              "tasks: a Ray task per shard, each a `batchjob run` process of its own (docs/guide/ray.md)")
@click.option("--output", help=OUTPUT_HELP)
def ray_submit_cmd(job: str, shards: int | None, address: str | None, cpus_per_shard: int, gpus_per_shard: float,
                   max_retries: int, runner: str, output: str | None) -> None:
    """Run JOB's shards on Ray, each `batchjob run JOB --shard K/N` into OUTPUT/shard-K-of-N/, until all are done;
    progress from the shards' manifests. Exits as `run` does: 0, 1 (a shard failed after its retries; the others
    complete), 75 (stopped by Ctrl-C or SIGTERM after the running shards drained)."""
    from pathlib import Path

    from batchjob.ray.submit import RayOptions, submit_and_wait

    try:
        cfg = load_job(job, {"output": output})
        if cfg.per_lane_inputs:
            raise ConfigError("lanes with their own inputs cannot be sharded; run each lane's input as its own job")
        opts = RayOptions(shards, address, cpus_per_shard, gpus_per_shard, max_retries, Runner(runner), output)
        done = submit_and_wait(Path(job), cfg.output, opts, log=lambda m: click.echo(m, err=True))
    except ConfigError as e:
        click.echo(f"batchjob: error: {e}", err=True)
        sys.exit(1)
    failed = [o for o in done.outcomes if o.exit_code not in (0, EXIT_RESUMABLE)]
    for o in failed:
        click.echo(f"batchjob: error: shard {o.index} failed after its retries: {o.error}", err=True)
    stopped = any(o.exit_code == EXIT_RESUMABLE for o in done.outcomes)
    click.echo(done.line("failed" if failed else "stopped" if stopped else "finished", Path(cfg.output)))
    if failed:
        sys.exit(1)
    if stopped:
        again = f" --output {output}" if output else ""
        click.echo(f"batchjob: stopped; rerun `batchjob ray submit {job}{again}` to continue", err=True)
        sys.exit(EXIT_RESUMABLE)
    click.echo(f"batchjob: `batchjob status {cfg.output}` shows each shard, `batchjob export {cfg.output} --to FILE` "
               "writes the rows in input order", err=True)


@main.command("bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                         "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench_cmd(args: tuple) -> None:
    """Benchmark batchjob against static batching, HF transformers and vLLM (issue 7); `batchjob bench --help`
    for the options. Same as `python -m batchjob.bench` / `make bench`."""
    from batchjob.bench.run import main as bench_main

    sys.exit(bench_main(list(args)))


if __name__ == "__main__":
    main()
