"""Readers for user data (pretrain / SFT / DPO): streamed, with errors that say where.

A `DataError` names the file, the row and, where there is one, the field:
    data/sft.jsonl:17: field 'conversations[1].role': expected one of 'system', 'user', 'assistant', got 'bot'
    data/sft.parquet: row 17: field 'output': missing
    data/alpaca.json:230: row 17: field 'output': missing       (JSON array: line, then row)

Inputs, by path (`iter_rows` yields each row as a dict):
- `.jsonl`: JSON Lines, read line by line; `.json` (or any other suffix): JSON Lines, or one
  top-level JSON array decoded a chunk at a time. Invalid UTF-8 is reported per line.
- `.txt`: one document `{"text": line}` per non-empty line (multi-line documents go in JSONL).
- `.parquet`, `.arrow` (IPC file or stream, as `datasets` writes): read in record batches.
- a directory saved with `datasets.Dataset.save_to_disk` (has state.json), read with
  `datasets.load_from_disk` in batches; a saved `DatasetDict` (has dataset_dict.json) means its
  "train" split; for another split pass its directory (`saved/test`).
Rows are numbered from 1: the line for JSONL and .txt, the row index otherwise.

Row shapes (extra keys are ignored; messages come back as plain `{"role", "content"}` dicts):
- pretrain: `{"text": str}`.
- SFT, detected per row: `conversations` or `messages` = a list of `{"role", "content"}` (roles
  system/user/assistant) or ShareGPT `{"from": "human"|"gpt"|"system", "value"}`, ending with
  the assistant; or Alpaca `instruction`, optional `input`, `output`, optional `system` →
  [system], user (instruction + "\\n\\n" + input when input is not blank), assistant (output).
- DPO: `chosen`/`rejected` conversations sharing every message but the last (the answer); or
  `prompt` (a string, or messages ending with the user's) with `chosen`/`rejected` each a string
  or a one-message assistant list (TRL). If `chosen` is a whole conversation, `prompt` is ignored.
Readers check shapes and types only; empty text is a cleaning matter (data.cleaning).

Bounded input (`max_line_bytes`, data.max_line_bytes, default 8 MiB): a JSONL or .txt line longer
than that is a bad row naming its line; it is never held in memory (the rest of the line is read
past in chunks), so with on_bad_row="skip" reading goes on at the next line. A JSON array element
longer than that, and a string (or binary) field over it in a Parquet/Arrow/save_to_disk row
(`row N: field 'conversations[1].content'`), are DataErrors too. A user's value quoted in a
message is cut to a few hundred characters (configs.errors.quote).

Bad rows: `on_bad_row="error"` (default) raises the DataError; `"skip"` counts the row in
`report` (a CleanReport) under "bad_row", keeps the first few messages, and goes on. A JSON array
that stops being valid JSON can't be resynchronised, so that one always raises; so does an
element over the limit (its end can't be found without holding it).
"""
from __future__ import annotations

import codecs
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from glm_lora.configs.errors import quote
from glm_lora.data.cleaning import CleanReport
from glm_lora.data.errors import DataError  # re-exported: `from data.formats import DataError` keeps working

Message = dict  # {"role": str, "content": str}
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
ON_BAD_ROW = ("error", "skip")

MAX_LINE_BYTES = 8 << 20  # default data.max_line_bytes: the longest line / row / string field read
_BATCH = 1024             # rows per Arrow batch turned into Python objects
_CHUNK = 1 << 20          # bytes read at a time from a JSON array, or skipped at a time in an over-long line
_BLANK = re.compile(r"[ \t\r\n\ufeff]*")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _size(n: int) -> str:
    """8388608 -> '8 MiB'; 1000000 -> '1000000 bytes'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _too_long(limit: int) -> str:
    return f"longer than data.max_line_bytes ({_size(limit)})"


@dataclass(frozen=True)
class _Row:
    """Where a value came from, so every check can raise a precise DataError."""

    where: str  # "file:line", "file: row N", or "file:line: row N" in a JSON array
    n: int      # row number: the line in JSONL/.txt, the 1-based row index otherwise

    def error(self, field: str | None, msg: str) -> DataError:
        return DataError(f"{self.where}: {f'field {quote(field)}: ' if field else ''}{msg}")  # (column names)

    def get(self, obj: dict, key: str, field: str | None = None) -> Any:
        if key not in obj:
            raise self.error(field or key, "missing")
        return obj[key]

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            raise self.error(field, f"expected a string, got {_kind(value)}")
        return value

    def optional_text(self, obj: dict, key: str) -> str:
        return "" if obj.get(key) is None else self.text(obj[key], key)

    def message(self, m: Any, field: str) -> Message:
        if not isinstance(m, dict):
            raise self.error(field, f"expected an object with 'role' and 'content' (or 'from' and 'value'), "
                                    f"got {_kind(m)}")
        if m.get("role") is None and m.get("from") is not None:  # ShareGPT
            who = m["from"]
            if not isinstance(who, str) or who not in SHAREGPT_ROLES:
                raise self.error(f"{field}.from", f"expected one of {', '.join(map(repr, SHAREGPT_ROLES))}, "
                                                  f"got {quote(who)}")
            return {"role": SHAREGPT_ROLES[who], "content": self.text(self.get(m, "value", f"{field}.value"),
                                                                      f"{field}.value")}
        role = self.get(m, "role", f"{field}.role")
        if role not in ROLES:
            raise self.error(f"{field}.role", f"expected one of {', '.join(map(repr, ROLES))}, got {quote(role)}")
        return {"role": role, "content": self.text(self.get(m, "content", f"{field}.content"), f"{field}.content")}

    def messages(self, value: Any, field: str, last: str = "assistant") -> list[Message]:
        """A non-empty list of messages, the last one from `last`."""
        if not isinstance(value, list):
            raise self.error(field, f"expected a list of messages, got {_kind(value)}")
        if not value:
            raise self.error(field, "empty conversation")
        out = [self.message(m, f"{field}[{i}]") for i, m in enumerate(value)]
        if out[-1]["role"] != last:
            raise self.error(f"{field}[{len(out) - 1}]",
                             f"the last message must be {last!r}, got {quote(out[-1]['role'])}")
        return out

    def answer(self, value: Any, field: str) -> Message:
        """A DPO answer: a string, or a list holding one assistant message."""
        if isinstance(value, str):
            return {"role": "assistant", "content": value}
        if not isinstance(value, list):
            raise self.error(field, f"expected a string or a one-message list, got {_kind(value)}")
        msgs = self.messages(value, field)
        if len(msgs) != 1:
            raise self.error(field, f"expected the answer alone (one assistant message), got {len(msgs)} messages")
        return msgs[0]

    def alpaca(self, obj: dict) -> list[Message]:
        instruction, output = self.text(obj["instruction"], "instruction"), self.text(self.get(obj, "output"), "output")
        inp, system = self.optional_text(obj, "input"), self.optional_text(obj, "system")
        user = f"{instruction}\n\n{inp}" if inp.strip() else instruction
        return ([{"role": "system", "content": system}] if system.strip() else []) + [
            {"role": "user", "content": user}, {"role": "assistant", "content": output}]


# ---------------------------------------------------------------- sources: (row, dict or DataError)

Source = Iterator[tuple[_Row, "dict | DataError"]]


def _object(row: _Row, obj: Any) -> dict | DataError:
    return obj if isinstance(obj, dict) else row.error(None, f"expected a JSON object, got {_kind(obj)}")


def _lines(path: Path, limit: int) -> Iterator[tuple[_Row, str | DataError]]:
    """Each line, decoded on its own so a bad byte names its line.

    A line over `limit` bytes (not counting its newline) is an error; it is never read whole: the
    rest of it is skipped a chunk at a time, and reading goes on at the next line.
    """
    with open(path, "rb") as f:
        n = 0
        while raw := f.readline(limit + 1):
            n += 1
            row = _Row(f"{path}:{n}", n)
            if len(raw) > limit and not raw.endswith(b"\n"):
                del raw
                yield row, row.error(None, f"line {_too_long(limit)}")
                while (rest := f.readline(_CHUNK)) and not rest.endswith(b"\n"):
                    pass
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield row, row.error(None, f"invalid UTF-8 at byte {e.start} of the line")
                continue
            yield row, line.lstrip("\ufeff") if n == 1 else line


def _txt(path: Path, limit: int) -> Source:
    for row, line in _lines(path, limit):
        if isinstance(line, DataError) or line.strip():
            yield row, line if isinstance(line, DataError) else {"text": line.rstrip("\r\n")}


def _jsonl(path: Path, limit: int) -> Source:
    for row, line in _lines(path, limit):
        if isinstance(line, DataError):
            yield row, line
        elif line.strip():
            try:
                yield row, _object(row, json.loads(line))
            except json.JSONDecodeError as e:
                yield row, row.error(None, f"invalid JSON ({e.msg} at column {e.colno})")


def _json_array(path: Path, limit: int) -> Source:
    """Elements of one top-level JSON array, decoded a chunk at a time (never the whole file).

    An element over `limit` bytes raises (even when skipping bad rows): its end can't be found
    without holding it, so at most about `limit` characters are ever buffered.
    """
    decode, utf8 = json.JSONDecoder().raw_decode, codecs.getincrementaldecoder("utf-8")()
    buf, pos, line, eof = "", 0, 1, False  # `line` is the line buf[pos] is on

    with open(path, "rb") as f:
        def fill() -> None:
            nonlocal buf, pos, eof
            raw = f.read(_CHUNK)
            try:
                text = utf8.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                at = line + buf.count("\n", pos) + e.object[:e.start].count(b"\n")
                raise DataError(f"{path}:{at}: invalid UTF-8") from None
            buf, pos, eof = buf[pos:] + text, 0, not raw

        def peek() -> str:  # the next non-blank character, "" at the end of the file
            nonlocal pos, line
            while True:
                end = _BLANK.match(buf, pos).end()
                line, pos = line + buf.count("\n", pos, end), end
                if pos < len(buf) or eof:
                    return buf[pos:pos + 1]
                fill()

        if peek() != "[":
            raise DataError(f"{path}:{line}: expected JSON Lines or a JSON array, got {peek()!r}")
        pos += 1
        n = 0
        while (c := peek()) != "]":
            if n:
                if c != ",":
                    raise DataError(f"{path}:{line}: invalid JSON (expected ',' or ']' after row {n}, "
                                    f"got {c or 'the end of the file'!r})")
                pos += 1
                peek()
            while True:  # decode one element, reading more while it may just be cut off
                try:
                    obj, end = decode(buf, pos)
                    if end < len(buf) or eof:
                        break
                except json.JSONDecodeError as e:
                    if len(buf) - pos > limit:  # characters: at least as many bytes
                        raise DataError(f"{path}:{line}: row {n + 1}: invalid JSON ({e.msg}), or an element "
                                        f"{_too_long(limit)}") from None
                    if eof:
                        at = line + buf.count("\n", pos, e.pos)
                        raise DataError(f"{path}:{at}: row {n + 1}: invalid JSON ({e.msg})") from None
                fill()
            n += 1
            row = _Row(f"{path}:{line}: row {n}", n)
            if end - pos > limit // 4 and len(buf[pos:end].encode("utf-8")) > limit:
                raise row.error(None, f"element {_too_long(limit)}")
            yield row, _object(row, obj)
            line, pos = line + buf.count("\n", pos, end), end
        pos += 1
        if peek():
            raise DataError(f"{path}:{line}: unexpected data after the JSON array")


def _is_list(t) -> bool:
    import pyarrow as pa

    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
            or pa.types.is_map(t) or getattr(pa.types, "is_list_view", lambda _: False)(t)
            or getattr(pa.types, "is_large_list_view", lambda _: False)(t))


def _is_bytes(t) -> bool:
    import pyarrow as pa

    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)
            or getattr(pa.types, "is_binary_view", lambda _: False)(t))


def _string_sizes(arr) -> Any:
    """Per row of an Arrow array: the byte length of the longest string (or binary) value anywhere
    inside it (0 for none), as a numpy array; None if the type holds no strings at all."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        parts = [_string_sizes(c) for c in arr.chunks]
        if all(p is None for p in parts):
            return None
        return np.concatenate([np.zeros(len(c), np.int64) if p is None else p for c, p in zip(arr.chunks, parts)]
                              or [np.zeros(0, np.int64)])
    t = arr.type
    if pa.types.is_dictionary(t):
        return _string_sizes(arr.dictionary_decode())
    if _is_bytes(t):
        return pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_struct(t):
        sizes = [s for s in map(_string_sizes, arr.flatten()) if s is not None]  # flatten: slice-aware
        return np.maximum.reduce(sizes) if sizes else None
    if _is_list(t):
        inner = _string_sizes(arr.flatten())  # the values of this slice's lists, non-null lists only
        if inner is None:
            return None
        lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
        out = np.zeros(len(arr), np.int64)
        np.maximum.at(out, np.repeat(np.arange(len(arr)), lengths), inner)
        return out
    return None


def _oversized_field(arr, limit: int, field: str) -> str:
    """The path to the first string over `limit` in a one-row array: 'conversations[1].content'."""
    import numpy as np
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_struct(arr.type):
        for name, child in zip((f.name for f in arr.type), arr.flatten()):
            sizes = _string_sizes(child)
            if sizes is not None and sizes.max(initial=0) > limit:
                return _oversized_field(child, limit, f"{field}.{name}")
    elif _is_list(arr.type):
        values = arr.flatten()
        sizes = _string_sizes(values)
        if sizes is not None and sizes.max(initial=0) > limit:
            k = int(np.argmax(sizes > limit))
            return _oversized_field(values.slice(k, 1), limit, f"{field}[{k}]")
    return field


def _table(where: str, batches: Iterable, limit: int) -> Source:
    """Rows of Arrow record batches/tables, turned into Python objects _BATCH rows at a time.

    A row holding a string over `limit` bytes is an error naming the field, and is never turned
    into Python objects.
    """
    import numpy as np

    n = 0
    for batch in batches:
        for i in range(0, batch.num_rows, _BATCH):
            part = batch.slice(i, _BATCH)
            worst = np.zeros(part.num_rows, np.int64)
            for column in part.columns:
                sizes = _string_sizes(column)
                if sizes is not None:
                    np.maximum(worst, sizes, out=worst)
            over = worst > limit
            if not over.any():
                for obj in part.to_pylist():
                    n += 1
                    yield _Row(f"{where}: row {n}", n), obj
                continue
            good = iter(part.take(np.flatnonzero(~over)).to_pylist())
            for j in range(part.num_rows):
                n += 1
                row = _Row(f"{where}: row {n}", n)
                if not over[j]:
                    yield row, next(good)
                    continue
                one = part.slice(j, 1)
                field = next(_oversized_field(col, limit, name) for name, col in zip(one.column_names, one.columns)
                             if (sizes := _string_sizes(col)) is not None and sizes.max(initial=0) > limit)
                yield row, row.error(field, f"a value of {int(worst[j])} bytes, {_too_long(limit)}")


def _parquet(path: Path) -> Iterator:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e)[:300]})") from None
    yield from file.iter_batches(batch_size=_BATCH)


def _arrow(path: Path) -> Iterator:
    import pyarrow as pa

    with pa.memory_map(str(path)) as src:
        try:
            reader = pa.ipc.open_file(src)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # `datasets` writes the streaming format
            src.seek(0)
            try:
                batches = pa.ipc.open_stream(src)
            except pa.ArrowInvalid as e:
                raise DataError(f"{path}: not a readable Arrow file ({str(e)[:300]})") from None
        yield from batches


def _saved_dataset(path: Path) -> Path:
    """The save_to_disk directory to read: `path` itself, or a saved DatasetDict's "train"."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if "train" not in splits:
            raise DataError(f"{path}: a saved DatasetDict without a 'train' split (has "
                            f"{_keys(dict.fromkeys(map(str, splits)))}); pass the split's directory"
                            + (f", e.g. {path / str(splits[0])[:100]}" if splits else ""))
        path = path / "train"
    if not (path / "state.json").is_file() and not (path / "dataset_info.json").is_file():
        raise DataError(f"{path}: a directory, but not one written by datasets' save_to_disk "
                        "(no state.json or dataset_dict.json)")
    return path


def _load_from_disk(path: Path) -> Iterator:
    import datasets  # slow to import; only here

    yield from datasets.load_from_disk(str(path)).with_format("arrow").iter(batch_size=_BATCH)


def _source(path: str | Path, limit: int) -> Source:
    p = Path(path)
    if p.is_dir():
        p = _saved_dataset(p)
        return _table(str(p), _load_from_disk(p), limit)
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".arrow"):
        return _table(str(p), (_parquet if suffix == ".parquet" else _arrow)(p), limit)
    if suffix == ".txt":
        return _txt(p, limit)
    if suffix != ".jsonl":
        with open(p, "rb") as f:
            if f.read(1 << 16).lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
                return _json_array(p, limit)
    return _jsonl(p, limit)


# ---------------------------------------------------------------- readers

def _read(path: str | Path, convert: Callable[[_Row, dict], Any], on_bad_row: str,
          report: CleanReport | None, max_line_bytes: int) -> Iterator[tuple[int, Any]]:
    """(row number, converted row), applying the bad-row policy; counts rows read into `report`."""
    if isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int) or max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be a positive number of bytes, got {quote(max_line_bytes)}")
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW}, got {quote(on_bad_row)}")
    if on_bad_row == "skip" and report is None:
        raise ValueError("on_bad_row='skip' needs report= (a CleanReport) to count the rows it skips")
    rows = _source(path, max_line_bytes)

    def gen() -> Iterator[tuple[int, Any]]:
        for row, obj in rows:
            if report is not None:
                report.rows += 1
            try:
                if isinstance(obj, DataError):
                    raise obj
                value = convert(row, obj)
            except DataError as e:
                if on_bad_row == "error":
                    raise
                report.drop("bad_row", str(e))
                continue
            yield row.n, value

    return gen()


def iter_rows(path: str | Path, *, on_bad_row: str = "error", report: CleanReport | None = None,
              max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, dict]]:
    """(row number, row dict) for each row of any supported input (see the module docstring)."""
    return _read(path, lambda row, obj: obj, on_bad_row, report, max_line_bytes)


def _pretrain(row: _Row, obj: dict) -> str:
    return row.text(row.get(obj, "text"), "text")


def _keys(obj: dict, shown: int = 10) -> str:
    keys = [quote(k, 40) for k in itertools.islice(obj, shown)]
    return (", ".join(keys) + (f", … ({len(obj)} keys)" if len(obj) > shown else "")) or "none"


def _sft(row: _Row, obj: dict) -> list[Message]:
    keys = ("conversations", "messages", "instruction")
    key = next((k for k in keys if obj.get(k) is not None), None) or next((k for k in keys if k in obj), None)
    if key is None:
        raise row.error(None, "expected a 'conversations' or 'messages' list, or Alpaca 'instruction' and "
                              f"'output'; got keys {_keys(obj)}")
    return row.alpaca(obj) if key == "instruction" else row.messages(obj[key], key)


class KTORow(NamedTuple):
    """An unpaired preference row (KTO): the prompt, one answer, and whether that answer is desirable."""

    prompt: list[Message]
    completion: Message
    desirable: bool


def _prompt(row: _Row, p: Any, field: str) -> list[Message]:
    if isinstance(p, list):
        return row.messages(p, field, last="user")
    if isinstance(p, str):
        return [{"role": "user", "content": p}]
    raise row.error(field, f"expected a string or a list of messages, got {_kind(p)}")


def _kto(row: _Row, obj: dict) -> KTORow:
    """{"prompt": str | messages, or "messages": messages, "completion": str | [assistant message], "label": bool}."""
    if "prompt" in obj:
        prompt = _prompt(row, obj["prompt"], "prompt")
    else:
        prompt = _prompt(row, row.get(obj, "messages", "prompt"), "messages")
    label = row.get(obj, "label")
    if not isinstance(label, bool):
        raise row.error("label", f"expected true (a desirable answer) or false, got {quote(label)}")
    return KTORow(prompt, row.answer(row.get(obj, "completion"), "completion"), label)


def _is_kto(obj: Any) -> bool:
    return isinstance(obj, dict) and "label" in obj and "completion" in obj


def _preference(row: _Row, obj: dict):
    """A KTO row or a DPO pair, whichever the row is (data.dpo holds either)."""
    return _kto(row, obj) if _is_kto(obj) else _dpo(row, obj)


def _dpo(row: _Row, obj: dict) -> tuple[list[Message], Message, Message]:
    if _is_kto(obj):
        raise row.error("label", "this is an unpaired KTO row (prompt, completion, label); it needs dpo.loss: kto, "
                                 "the paired losses (dpo, ipo, simpo, orpo) read chosen/rejected pairs")
    chosen_raw = obj.get("chosen")
    if "prompt" in obj and not (isinstance(chosen_raw, list) and len(chosen_raw) > 1):
        prompt = _prompt(row, obj["prompt"], "prompt")
        return prompt, row.answer(row.get(obj, "chosen"), "chosen"), row.answer(row.get(obj, "rejected"), "rejected")
    chosen = row.messages(row.get(obj, "chosen"), "chosen")
    rejected = row.messages(row.get(obj, "rejected"), "rejected")
    if len(chosen) < 2:
        raise row.error("chosen", "needs at least one prompt message before the assistant answer")
    if len(rejected) != len(chosen):
        raise row.error("rejected", f"has {len(rejected)} messages, 'chosen' has {len(chosen)}; "
                                    "both must be the same prompt plus one answer")
    for i, (c, r) in enumerate(zip(chosen[:-1], rejected[:-1])):
        if c != r:
            raise row.error(f"rejected[{i}]", f"differs from 'chosen[{i}]'; all but the last message must be the "
                                              "same prompt")
    if chosen[-2]["role"] != "user":
        raise row.error(f"chosen[{len(chosen) - 2}]",
                        f"the prompt must end with 'user', got {quote(chosen[-2]['role'])}")
    return chosen[:-1], chosen[-1], rejected[-1]


def read_preferences(path: str | Path, *, on_bad_row: str = "error", report: CleanReport | None = None,
                     max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[list[Message], Message, Message] | KTORow]:
    """Per row a DPO pair (prompt, chosen, rejected) or a KTORow, whichever the row is: what data.dpo may hold."""
    return (v for _, v in _read(path, _preference, on_bad_row, report, max_line_bytes))


def read_kto(path: str | Path, *, on_bad_row: str = "error", report: CleanReport | None = None,
             max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[KTORow]:
    """KTO rows; a DPO pair is read as two of them (chosen: desirable, rejected: not), as TRL unpairs them."""
    for row in read_preferences(path, on_bad_row=on_bad_row, report=report, max_line_bytes=max_line_bytes):
        if isinstance(row, KTORow):
            yield row
        else:
            prompt, chosen, rejected = row
            yield KTORow(prompt, chosen, True)
            yield KTORow(prompt, rejected, False)


def read_pretrain(path: str | Path, *, on_bad_row: str = "error", report: CleanReport | None = None,
                  max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[str]:
    """Documents: each row's "text" (each non-empty line of a .txt file)."""
    return (v for _, v in _read(path, _pretrain, on_bad_row, report, max_line_bytes))


def read_sft(path: str | Path, *, on_bad_row: str = "error", report: CleanReport | None = None,
             max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[list[Message]]:
    """Conversations from chat rows (`conversations` / `messages`, role/content or ShareGPT) or Alpaca rows."""
    return (v for _, v in _read(path, _sft, on_bad_row, report, max_line_bytes))


def read_sft_rows(path: str | Path, *, on_bad_row: str = "error", report: CleanReport | None = None,
                  max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[list[Message], dict]]:
    """(conversation, the row itself) per good row, for callers that need other fields (e.g. "task")."""
    return (v for _, v in _read(path, lambda row, obj: (_sft(row, obj), obj), on_bad_row, report, max_line_bytes))


def read_dpo(path: str | Path, *, on_bad_row: str = "error", report: CleanReport | None = None,
             max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[list[Message], Message, Message]]:
    """(prompt messages, chosen answer, rejected answer) per row."""
    return (v for _, v in _read(path, _dpo, on_bad_row, report, max_line_bytes))
