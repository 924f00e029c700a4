"""Safetensors files read one tensor at a time and written in files of bounded size, so a checkpoint larger than
memory (GLM-4.5-Air: 212 GB in bf16) goes through import and loading without ever being held whole.

Layout of a set of tensors named `<stem>` in a directory (Hugging Face's own, as `save_pretrained` writes it):
  <stem>.safetensors                                    everything, when it fits in one file of `max_file_bytes`
  <stem>-00001-of-0000N.safetensors … + <stem>.safetensors.index.json   otherwise; the index (HF's format:
                                                        {"metadata": {"total_size"}, "weight_map": {name: file}})
                                                        is written last, so a set without it is not readable
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm_lora.artifacts.manifest import atomic_write_text

# One file's tensors are held in memory until it is written: this bounds what writing takes (a tensor larger than
# this gets a file of its own). 4 GiB holds a GLM-4.5-Air layer's stacked gate/up experts (2.95 GB in bf16).
MAX_FILE_BYTES = 4 * 2**30


def index_name(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def files_of(path: Path, stem: str) -> list[Path]:
    """The files of the tensor set `stem` in `path` ([] if there is none): the single file, or those its index names."""
    path = Path(path)
    single, index = path / f"{stem}.safetensors", path / index_name(stem)
    if single.is_file():
        return [single]
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({e})") from None
    files = [path / f for f in sorted(set(weight_map.values()))]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names {missing[0].name}, which is missing from {path}")
    return files


class TensorFiles:
    """The tensors of some safetensors files by name, each read alone when asked for. A tensor it gives is a
    copy-on-write view of the memory-mapped file (safetensors' default): page cache until written, not memory of the
    process, and still valid once the files are closed. A context manager: the files stay open until it exits."""

    def __init__(self, files: Iterable[Path]):
        self._stack = contextlib.ExitStack()
        self.where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        for f in files:
            handle = self._stack.enter_context(safe_open(str(f), framework="pt"))
            for name in handle.keys():
                if name in self.where:
                    self._stack.close()
                    raise ValueError(f"{f}: tensor {name!r} is in {self.where[name]} too")
                self.where[name] = Path(f)
            self._open[Path(f)] = handle

    @classmethod
    def of(cls, path: Path, stem: str) -> "TensorFiles":
        """The tensor set `stem` in `path` (none: empty); an index that disagrees with its files is refused."""
        files = cls(files_of(path, stem))
        index = Path(path) / index_name(stem)
        if len(files._open) and not (Path(path) / f"{stem}.safetensors").is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            held = {name: f.name for name, f in files.where.items()}
            if held != weight_map:
                files.close()
                wrong = sorted(set(held.items()) ^ set(weight_map.items()))[0][0]
                raise ValueError(f"{index}: tensor {wrong!r} is not where the index says (a half-written checkpoint?)")
        return files

    def __enter__(self) -> "TensorFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self._open[self.where[name]].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """From the file's header: nothing is read."""
        return tuple(self._open[self.where[name]].get_slice(name).get_shape())

    def row(self, name: str, i: int) -> torch.Tensor:
        """`tensor[i]` read alone (one routed expert of a stack)."""
        return self._open[self.where[name]].get_slice(name)[i:i + 1][0]


def write_tensors(out_dir: Path, stem: str, tensors: Iterable[tuple[str, torch.Tensor]],
                  max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Write (name, tensor) pairs, as they come, as the tensor set `stem` of `out_dir` (see the module docstring),
    holding at most one file's tensors. Each file is written under a hidden name and renamed when all are done, the
    index last; a set of the other layout left in `out_dir` from before is removed first."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_tensors(out_dir, stem)
    written: list[tuple[Path, list[str], int]] = []
    batch: dict[str, torch.Tensor] = {}
    size = 0
    try:
        for name, t in tensors:
            n = t.numel() * t.element_size()
            if batch and size + n > max_file_bytes:
                written.append(_write_part(out_dir, stem, len(written), batch))
                batch, size = {}, 0
            batch[name], size = t.contiguous(), size + n
        if batch or not written:
            written.append(_write_part(out_dir, stem, len(written), batch))
        batch = {}
        if len(written) == 1:
            os.replace(written[0][0], out_dir / f"{stem}.safetensors")
            return
        names = [f"{stem}-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
        for (tmp, _, _), name in zip(written, names):
            os.replace(tmp, out_dir / name)
    except BaseException:
        for tmp, _, _ in written:
            tmp.unlink(missing_ok=True)
        raise
    index = {"metadata": {"total_size": sum(s for _, _, s in written)},
             "weight_map": {k: name for (_, keys, _), name in zip(written, names) for k in keys}}
    atomic_write_text(out_dir / index_name(stem), json.dumps(index, indent=2))


def remove_tensors(out_dir: Path, stem: str) -> None:
    """The tensor set `stem` of `out_dir` removed, in either layout (tensors still read from it stay readable: a
    memory-mapped file lives on until its last mapping goes)."""
    out_dir = Path(out_dir)
    for old in [out_dir / f"{stem}.safetensors", out_dir / index_name(stem), *out_dir.glob(f"{stem}-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)


def _write_part(out_dir: Path, stem: str, i: int, batch: dict[str, torch.Tensor]) -> tuple[Path, list[str], int]:
    tmp = out_dir / f".{stem}-part{i + 1:05d}.safetensors.tmp"
    save_file(batch, tmp, metadata={"format": "pt"})
    return tmp, list(batch), sum(t.numel() * t.element_size() for t in batch.values())
