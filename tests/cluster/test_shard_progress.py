"""The driver's progress over a sharded job's folder (`batchjob ray submit`), read from the shards' manifests: a bar
on a terminal (rows done of the total, shards running), a plain line elsewhere, and a line saying so before any shard
has planned the job."""
from __future__ import annotations

import io
import json

from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.sharding.shard_progress import ShardProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_reads_the_shards_manifests_as_a_bar_or_lines(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    plain = ShardProgress(out, stream=io.StringIO())
    plain.tick(force=True)
    assert "no shard has planned the job yet" in plain.stream.getvalue()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(8)))
    job = tmp_path / "job.toml"
    job.write_text(f'model = "{tiny_model_dir("llama")}"\ninput = "{src}"\noutput = "{out}"\n'
                   "[sampling]\nmax_tokens = 3\n[engine]\nkv_cache_gb = 0.02\n")
    result = CliRunner().invoke(main, ["run", str(job), "--shard", "0/2", "--no-progress"])  # half the rows
    assert result.exit_code == 0, result.output
    plain.tick(force=True)
    assert "batchjob: 4 / 8 rows (50.0%), 0 of 2 shards running" in plain.stream.getvalue()
    bar = ShardProgress(out, stream=Terminal())
    bar.close()  # draws the last state
    drawn = bar.stream.getvalue()
    assert " 50%|" in drawn and "4/8 rows" in drawn and "0 of 2 shards running" in drawn
