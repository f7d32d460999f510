"""docs/guide/kubernetes.md's Indexed Job: the manifest is one, and its command, run once per index with the variables
Kubernetes (JOB_COMPLETION_INDEX) and the manifest (JOB_COMPLETIONS) set, shards the job like a Slurm array."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.sharding.shards import ShardSpec
from batchjob.sharding.sharded_output import shard_states
from batchjob.errors import ConfigError
from batchjob.io.parts import read_results

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "kubernetes.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", GUIDE.read_text(), re.S)


def test_the_pod_variables_give_the_shard():
    assert ShardSpec.resolve(None, {"JOB_COMPLETION_INDEX": "2", "JOB_COMPLETIONS": "4"}) == ShardSpec(2, 4)
    assert ShardSpec.resolve("1/3", {"JOB_COMPLETION_INDEX": "2", "JOB_COMPLETIONS": "4"}) == ShardSpec(1, 3)
    assert ShardSpec.resolve("none", {"JOB_COMPLETION_INDEX": "2", "JOB_COMPLETIONS": "4"}) is None
    slurm = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"}  # a Slurm array task's come first
    assert ShardSpec.resolve(None, {**slurm, "JOB_COMPLETION_INDEX": "2", "JOB_COMPLETIONS": "4"}) == ShardSpec(1, 2)
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX=2.*JOB_COMPLETIONS is not set.*kubernetes.md"):
        ShardSpec.resolve(None, {"JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX='4' and JOB_COMPLETIONS='4'"):
        ShardSpec.resolve(None, {"JOB_COMPLETION_INDEX": "4", "JOB_COMPLETIONS": "4"})
    with pytest.raises(ConfigError, match="JOB_COMPLETIONS='four'"):
        ShardSpec.resolve(None, {"JOB_COMPLETION_INDEX": "0", "JOB_COMPLETIONS": "four"})


def test_the_guides_indexed_job_runs_as_its_shards(tmp_path, tiny_model_dir, monkeypatch):
    (manifest,) = [yaml.safe_load(b) for b in blocks("yaml")]
    assert manifest["apiVersion"] == "batch/v1" and manifest["kind"] == "Job"
    spec = manifest["spec"]
    assert spec["completionMode"] == "Indexed" and spec["template"]["spec"]["restartPolicy"] == "Never"
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    count = spec["completions"]
    assert env["JOB_COMPLETIONS"] == str(count) and count > 1
    mount = container["volumeMounts"][0]["mountPath"]
    assert container["command"][:2] == ["batchjob", "run"]
    # the pod's drain fits in its grace period (SIGTERM, then SIGKILL after terminationGracePeriodSeconds)
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > 60

    # the guide's job file and command, with the volume at tmp_path and the tiny model and 21 prompts on it
    data = tmp_path / mount.strip("/")
    data.mkdir()
    (data / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Item {i}: say"}) + "\n" for i in range(21)))
    (job_toml,) = blocks("toml")
    job_toml = re.sub(r'model = ".*"', f'model = "{tiny_model_dir("llama", max_positions=1024)}"', job_toml)
    job_toml = job_toml.replace(mount, str(data)).replace("max_tokens = 512", "max_tokens = 5")
    (data / "job.toml").write_text(job_toml)
    args = [a.replace(mount, str(data)) for a in container["command"][1:]] + ["--no-progress", "--kernels", "torch"]
    for index in reversed(range(count)):  # indexes start in any order
        monkeypatch.setenv("JOB_COMPLETION_INDEX", str(index))  # Kubernetes sets it in each pod
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        done = CliRunner().invoke(main, args, catch_exceptions=False)
        assert done.exit_code == 0, done.output
    out = Path(args[args.index("--output") + 1])
    job, states = shard_states(out)
    assert job.shards == count and all(s.complete for s in states)
    merged = pa.concat_tables([read_results(s.folder) for s in states])

    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    done = CliRunner().invoke(main, [*args[:args.index("--output")], "--output", str(tmp_path / "single"),
                                     "--no-progress", "--kernels", "torch"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert merged.column("row_index").to_pylist() == list(range(21))
    assert merged.to_pylist() == read_results(tmp_path / "single").to_pylist()
