"""artifacts/: manifests, digests, verification and atomic publishing."""
import json
import os
from pathlib import Path

import pytest

from glm_lora.artifacts import manifest as artifacts
from glm_lora.artifacts.manifest import ArtifactRef, build, is_complete, read_manifest, ref_for, sha256_file, stage_output, staging_dir, verify


def writer(files: dict[str, bytes], metrics=None):
    def fn(tmp: Path):
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        return metrics
    return fn


FILES = {"model.safetensors": b"\x00\x01weights" * 10, "sub/config.json": b'{"a": 1}'}


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_build_publishes_with_manifest(tmp_path):
    final = tmp_path / "run" / "sft"
    upstream = ArtifactRef("data", "/somewhere/data", "d" * 64)
    ref = build(final, "sft", writer(FILES, {"loss": 1.5}), config={"lr": 0.1}, inputs=[upstream])
    assert ref.stage == "sft" and Path(ref.path) == final.resolve()
    m = read_manifest(final)
    assert m["stage"] == "sft" and m["digest"] == ref.digest
    assert set(m["files"]) == {"model.safetensors", "sub/config.json"}        # manifest not listed in itself
    assert m["files"]["model.safetensors"] == {"sha256": sha256_file(final / "model.safetensors"),
                                               "size": len(FILES["model.safetensors"])}
    assert m["config"] == {"lr": 0.1} and m["metrics"] == {"loss": 1.5}
    assert m["inputs"] == [upstream.to_dict()]
    assert (final / "sub" / "config.json").read_bytes() == FILES["sub/config.json"]
    assert verify(final) == m and is_complete(final)
    assert ref_for(final) == ref and ref.manifest() == m
    assert ArtifactRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref
    assert leftovers(final.parent, "sft") == []


def test_fn_returning_none_gives_empty_metrics(tmp_path):
    build(tmp_path / "a", "x", writer(FILES, None))
    assert read_manifest(tmp_path / "a")["metrics"] == {}


def test_digest_depends_on_content_not_metrics_or_config(tmp_path):
    a = build(tmp_path / "a", "s", writer(FILES, {"loss": 1.0}), config={"k": 1})
    b = build(tmp_path / "b", "s", writer(FILES, {"loss": 9.0, "t": 3}), config={"k": 2})
    assert a.digest == b.digest
    c = build(tmp_path / "c", "s", writer({**FILES, "sub/config.json": b'{"a": 2}'}))
    d = build(tmp_path / "d", "s", writer({"renamed.safetensors": FILES["model.safetensors"],
                                           "sub/config.json": FILES["sub/config.json"]}))
    assert len({a.digest, c.digest, d.digest}) == 3


def _built(tmp_path) -> Path:
    final = tmp_path / "art"
    build(final, "s", writer(FILES))
    return final


def test_verify_detects_flipped_byte(tmp_path):
    final = _built(tmp_path)
    p = final / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[5] ^= 0x01
    p.write_bytes(bytes(data))            # same size: only the hash can tell
    with pytest.raises(ValueError, match=r"model.safetensors: content does not match"):
        verify(final)
    assert not is_complete(final)


def test_verify_detects_truncation(tmp_path):
    final = _built(tmp_path)
    p = final / "sub" / "config.json"
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"config.json: content does not match"):
        verify(final)
    assert not is_complete(final)


def test_verify_detects_missing_file(tmp_path):
    final = _built(tmp_path)
    (final / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model.safetensors: listed in .*manifest.json but missing"):
        verify(final)
    assert not is_complete(final)


def test_missing_or_corrupt_manifest_is_incomplete(tmp_path):
    final = _built(tmp_path)
    (final / "manifest.json").write_text("{not json")
    assert not is_complete(final)
    (final / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="did not finish"):
        read_manifest(final)
    assert not is_complete(final)
    assert not is_complete(tmp_path / "never-built")


def test_failing_fn_keeps_previous_artifact_and_no_temp_dirs(tmp_path):
    final = _built(tmp_path)
    good = read_manifest(final)

    def bad(tmp: Path):
        (tmp / "model.safetensors").write_bytes(b"half-written")
        raise RuntimeError("stage crashed")
    with pytest.raises(RuntimeError, match="stage crashed"):
        build(final, "s", bad)
    assert read_manifest(final) == good
    assert verify(final)["digest"] == good["digest"]
    assert (final / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert leftovers(tmp_path, "art") == []


def test_failing_fn_with_no_previous_artifact_publishes_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "new", "s", lambda tmp: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert not (tmp_path / "new").exists()
    assert leftovers(tmp_path, "new") == []


def test_staging_dir_replaces_existing_artifact(tmp_path):
    final = _built(tmp_path)
    (final / "stale.bin").write_bytes(b"old")
    with staging_dir(final, stage_output("s")) as tmp:
        assert tmp.parent == final.parent.resolve() and tmp.name.startswith(".art.tmp-")
        assert (final / "stale.bin").read_bytes() == b"old"      # the old artifact is served until the swap
        (tmp / "fresh.txt").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["fresh.txt"]
    assert leftovers(tmp_path, "art") == []


def test_rebuild_replaces_files_and_manifest(tmp_path):
    final = _built(tmp_path)
    ref = build(final, "s", writer({"only.txt": b"v2"}, {"loss": 0.1}))
    m = verify(final)
    assert set(m["files"]) == {"only.txt"} and m["digest"] == ref.digest and m["metrics"] == {"loss": 0.1}
    assert not (final / "model.safetensors").exists()


def test_atomic_write_text_leaves_no_temp(tmp_path):
    p = tmp_path / "d" / "x.json"
    artifacts.atomic_write_text(p, "one")
    artifacts.atomic_write_text(p, "two")
    assert p.read_text() == "two"
    assert os.listdir(p.parent) == ["x.json"]


def test_still_published_tracks_digest_and_files(tmp_path):
    final = _built(tmp_path)
    ref = ref_for(final).to_dict()
    assert artifacts.still_published(ref)
    assert not artifacts.still_published({**ref, "digest": "0" * 64})
    p = final / "sub" / "config.json"
    p.write_bytes(p.read_bytes() + b" ")            # size change: cheap check catches it
    assert not artifacts.still_published(ref)
    p.unlink()
    assert not artifacts.still_published(ref)
    assert not artifacts.still_published({**ref, "path": str(tmp_path / "gone")})
