"""`--model org/name[@revision]`: a snapshot in the local Hugging Face cache, found without the network (and without
huggingface_hub), in the layout `huggingface-cli download` leaves: blobs/, snapshots/<commit>/ of symlinks, refs/."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io.parts import read_results
from batchjob.models.loader import ModelLoadError, hf_hub_cache, load_model, resolve_model_path
from tests.builders import write_jsonl

HF_COMMIT = "3c8f1e2a9b7d6c5e4f3a2b1c0d9e8f7a6b5c4d3e"  # snapshot: the tiny Llama as an HF folder
GGUF_COMMIT = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"  # an older snapshot: the same model as one GGUF file


def add_snapshot(repo: Path, commit: str, files: list[Path]) -> Path:
    """Files into blobs/ (named by content hash) and snapshots/<commit>/ as relative symlinks to them."""
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in files:
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def add_ref(repo: Path, name: str, commit: str) -> None:
    (repo / "refs" / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / name).write_text(commit)  # huggingface_hub writes the hash without a newline


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny_model_dir, tiny_gguf_path):
    """$HF_HUB_CACHE with models--acme--tiny-llama: refs/main -> the HF folder, refs/v0.1 -> the GGUF."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    add_snapshot(repo, HF_COMMIT, sorted(p for p in tiny_model_dir("llama").iterdir() if p.is_file()))
    add_snapshot(repo, GGUF_COMMIT, [tiny_gguf_path("llama", "Q8_0")])
    add_ref(repo, "main", HF_COMMIT)
    add_ref(repo, "v0.1", GGUF_COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return repo


def run_cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", *map(str, args), "--no-progress"], catch_exceptions=False)
    return result.exit_code, result.output


def test_a_job_with_a_model_id_writes_what_the_same_model_by_path_writes(hf_cache, tiny_model_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The quick brown fox number {i}"} for i in range(4)])
    texts = {}
    for spec in (tiny_model_dir("llama"), "acme/tiny-llama", f"acme/tiny-llama@{HF_COMMIT}"):
        out = tmp_path / f"out{len(texts)}"
        code, printed = run_cli("--model", spec, "--input", src, "--output", out, "--max-tokens", 8, "--kernels", "torch")
        assert code == 0, printed
        texts[str(spec)] = read_results(out).column("generated_text").to_pylist()
        if str(spec).startswith("acme/"):
            assert "batchjob: acme/tiny-llama (" in printed  # the id, not the snapshot's commit hash
    by_path, *by_id = texts.values()
    assert all(t == by_path for t in by_id) and any(by_path)


def test_revisions(hf_cache):
    snapshots = hf_cache / "snapshots"
    assert resolve_model_path("acme/tiny-llama") == (snapshots / HF_COMMIT).resolve()  # refs/main
    assert resolve_model_path(f"acme/tiny-llama@{HF_COMMIT}") == (snapshots / HF_COMMIT).resolve()
    assert resolve_model_path("acme/tiny-llama@main") == (snapshots / HF_COMMIT).resolve()
    assert resolve_model_path("acme/tiny-llama@v0.1") == (snapshots / GGUF_COMMIT).resolve()  # a tag
    assert resolve_model_path(f"acme/tiny-llama@{GGUF_COMMIT[:10]}") == (snapshots / GGUF_COMMIT).resolve()
    gguf = load_model("acme/tiny-llama@v0.1")  # its .gguf is a symlink to a blob without the suffix
    assert gguf.identity["format"] == "gguf" and gguf.name == "tiny-llama.Q8_0"
    link = snapshots / GGUF_COMMIT / "tiny-llama.Q8_0.gguf"  # the symlink by its path: still a .gguf
    assert resolve_model_path(str(link)) == link.parent.resolve() / link.name and load_model(str(link)).name == gguf.name
    by_id = load_model("acme/tiny-llama")  # what the job fingerprint holds: the same as the snapshot's path gives
    assert by_id.identity == load_model(str(snapshots / HF_COMMIT)).identity
    assert by_id.identity["path"] == str((snapshots / HF_COMMIT).resolve()) and by_id.name == "acme/tiny-llama"

    (hf_cache / "refs" / "main").unlink()  # no refs/main: the default is ambiguous between two snapshots...
    with pytest.raises(ModelLoadError, match=r"no snapshot for revision 'main' \(refs: v0\.1; snapshots: 3c8f1e2a9b7d, a1b2c3d4e5f6\)"):
        resolve_model_path("acme/tiny-llama")
    shutil.rmtree(snapshots / GGUF_COMMIT)  # ... but not with one
    assert resolve_model_path("acme/tiny-llama") == (snapshots / HF_COMMIT).resolve()


def test_unknown_revision_and_unfinished_snapshot(hf_cache):
    with pytest.raises(ModelLoadError, match=r"'acme/tiny-llama@v9'.*no snapshot for revision 'v9' \(refs: main, v0\.1; "
                                             r".*huggingface-cli download acme/tiny-llama --revision v9$"):
        resolve_model_path("acme/tiny-llama@v9")
    for f in (hf_cache / "snapshots" / GGUF_COMMIT).iterdir():  # the blob never arrived: a dangling symlink
        (hf_cache / "blobs" / f.resolve().name).unlink()
    with pytest.raises(ModelLoadError, match=r"snapshot .*a1b2c3d4.* has neither config\.json nor a \.gguf file"):
        resolve_model_path("acme/tiny-llama@v0.1")


def test_an_id_not_in_the_cache_is_one_line_saying_where_and_how_to_fetch(hf_cache, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    code, printed = run_cli("--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--input", src, "--output", tmp_path / "out")
    assert code == 1
    assert printed.strip().splitlines() == [
        f"batchjob: error: model 'HuggingFaceTB/SmolLM2-135M-Instruct': not a file or folder here, and not in the "
        f"Hugging Face cache {hf_cache.parent} (no models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots); "
        f"fetch it with: huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert not (tmp_path / "out").exists()


def test_an_existing_path_wins_over_an_id(hf_cache, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir("qwen2"), tmp_path / "acme" / "tiny-llama")
    assert resolve_model_path("acme/tiny-llama") == (tmp_path / "acme" / "tiny-llama").resolve()
    assert load_model("acme/tiny-llama").config.architecture == "qwen2"


def test_the_cache_folder_is_found_as_huggingface_hub_finds_it(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hf_hub_cache() == tmp_path / "elsewhere"


def test_resolving_an_id_imports_no_huggingface_hub(hf_cache):
    code = ("import sys; from batchjob.models.loader import resolve_model_path; "
            "print(resolve_model_path('acme/tiny-llama')); assert 'huggingface_hub' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.strip() == str((hf_cache / "snapshots" / HF_COMMIT).resolve())
