"""Hugging Face Hub ids (`org/name`, `org/name@revision`) through every entry point, offline: a
cache laid out in the hub's own layout (models--org--name/{blobs,refs,snapshots}) under
HF_HUB_CACHE with HF_HUB_OFFLINE=1, read by huggingface_hub itself. Nothing is downloaded."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

import batchgen
from batchgen import Engine, ModelLoadError, SamplingParams
from batchgen.cli import main
from batchgen.cluster.spec import EngineSpec
from batchgen.models import hub
from batchgen.models.info import ModelInfo

REPO_ID = "tiny-org/tiny-qwen"
SHA = "0123456789abcdef0123456789abcdef01234567"
OPTIONS = {"kv_cache_bytes": 16 << 20}
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def lay_out_cache(cache: Path, repo: str, checkpoint: Path, sha: str = SHA) -> Path:
    """`checkpoint`'s files as the hub's cache holds a download: content-addressed blobs,
    snapshot entries linking to them, refs/main naming the commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / sha
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(checkpoint.iterdir()):
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(sha)
    return snapshot


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("qwen2")


@pytest.fixture
def offline_cache(tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    lay_out_cache(cache, REPO_ID, ckpt)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local directory named like the id
    return cache


def test_an_id_resolves_to_its_cached_snapshot(offline_cache: Path, ckpt: Path) -> None:
    snapshot = offline_cache / "models--tiny-org--tiny-qwen" / "snapshots" / SHA
    for spelling in (REPO_ID, f"{REPO_ID}@main", f"{REPO_ID}@{SHA}"):
        assert hub.model_dir(spelling) == snapshot
    assert hub.parse_hub_id(f"{REPO_ID}@v1.0") == (REPO_ID, "v1.0")
    assert hub.parse_hub_id("/abs/dir") is None and hub.parse_hub_id("a/b/c") is None
    assert ModelInfo.load(REPO_ID).vocab_size == ModelInfo.load(ckpt).vocab_size


def test_engine_and_generate_take_an_id(offline_cache: Path, ckpt: Path, prompt_ids: list[list[int]]) -> None:
    prompts = [prompt_ids[1], prompt_ids[3]]
    expected = [o.token_ids for o in Engine(ckpt, **OPTIONS).generate(prompts, GREEDY)]
    assert [o.token_ids for o in Engine(REPO_ID, **OPTIONS).generate(prompts, GREEDY)] == expected
    spec = EngineSpec.make(REPO_ID, OPTIONS)
    assert spec.model == REPO_ID  # each worker resolves the id in its own cache
    pdf = pd.DataFrame({"prompt": ["alpha beta", "gamma"]})
    by_id = batchgen.generate(pdf, model=f"{REPO_ID}@{SHA}", engine_options=OPTIONS, max_tokens=4,
                              temperature=0.0, ignore_eos=True)
    by_dir = batchgen.generate(pdf, model=ckpt, engine_options=OPTIONS, max_tokens=4, temperature=0.0,
                               ignore_eos=True)
    assert by_id["error"].isna().all() and by_id["generated_text"].tolist() == by_dir["generated_text"].tolist()


def test_a_local_directory_wins(tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ckpt, tmp_path / "tiny-org" / "local-only")
    assert hub.model_dir("tiny-org/local-only") == Path("tiny-org/local-only")
    assert EngineSpec.make("tiny-org/local-only").model == str(tmp_path / "tiny-org" / "local-only")
    assert Engine("tiny-org/local-only", **OPTIONS).generate([[1, 2, 3]], GREEDY)[0].num_generated_tokens == 5


def test_an_id_missing_offline_fails_at_load_saying_how_to_download(offline_cache: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"'tiny-org/absent'.*HF_HUB_OFFLINE.*hf download tiny-org/absent"):
        Engine("tiny-org/absent")
    with pytest.raises(ModelLoadError, match=r"hf download tiny-org/absent --revision v2"):
        batchgen.generate(pd.DataFrame({"prompt": ["x"]}), model="tiny-org/absent@v2")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "x"}}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", "--model", "tiny-org/absent", "--input", str(src), "--output", str(out)]) == 2
    assert "hf download tiny-org/absent" in capsys.readouterr().err and not out.exists()
    assert time.monotonic() - start < 10


def test_a_snapshot_without_weights_is_no_engine(offline_cache: Path, ckpt: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            shutil.copyfile(f, partial / f.name)
    lay_out_cache(offline_cache, "tiny-org/no-weights", partial)
    assert ModelInfo.load("tiny-org/no-weights").vocab_size > 0  # a driver needs no shards
    with pytest.raises(ModelLoadError, match="tiny-org/no-weights.*hf download"):
        Engine("tiny-org/no-weights")


def test_a_process_resolves_an_id_once_under_the_cache_lock(offline_cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import huggingface_hub

    calls: list[str] = []
    real = huggingface_hub.snapshot_download

    def counting(repo_id: str, **kwargs: object) -> str:
        calls.append(repo_id)
        return real(repo_id, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", counting)
    monkeypatch.setattr(hub, "_resolved", {})  # this test's process starts with nothing resolved
    threads = [threading.Thread(target=hub.model_dir, args=(f"{REPO_ID}@{SHA}",)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hub.model_dir(f"{REPO_ID}@{SHA}")
    assert calls == [REPO_ID]  # one look into the cache, however many engines and tasks ask
    assert not (offline_cache / ".locks").exists()  # a cached snapshot is read without writing (read-only caches)


def test_a_download_happens_once_per_host_under_the_cache_lock(offline_cache: Path, ckpt: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Online, an id missing from the cache is fetched by one process while the others wait on
    the cache's lock; here the fetch lays the files out as huggingface_hub would."""
    import threading

    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "is_offline", lambda: False)
    monkeypatch.setattr(hub, "_resolved", {})
    real = huggingface_hub.snapshot_download
    fetched: list[str] = []
    lock = offline_cache / ".locks" / "models--tiny-org--fetched" / "batchgen-resolve.lock"

    def fake_hub(repo_id: str, **kwargs: object) -> str:
        if not kwargs.get("local_files_only"):
            assert lock.exists()  # fetched under the lock
            fetched.append(repo_id)
            time.sleep(0.2)  # long enough for the other processes' threads to queue on the lock
            lay_out_cache(offline_cache, repo_id, ckpt)
        return real(repo_id, **{**kwargs, "local_files_only": True})  # type: ignore[arg-type]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub)
    # separate "processes": each thread has its own memo, so only the file lock keeps them apart
    results: list[Path] = []

    def one_process() -> None:
        results.append(hub._resolve("tiny-org/fetched", None, True, offline_cache))  # noqa: SLF001

    threads = [threading.Thread(target=one_process) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fetched == ["tiny-org/fetched"] and len(set(results)) == 1 and len(results) == 3
