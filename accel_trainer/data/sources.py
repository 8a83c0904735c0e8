"""A user's data named on the command line (`data=`, `eval_data=`), read through `datasets` as a real set is read.

One spec is one source or a weighted mixture of several, separated by commas, each `WHERE[:WEIGHT]`:
- a text file, a folder of them or a glob (`.txt`, `.md`): datasets' `text` loader, one row per paragraph (text
  between blank lines), as the built-in demo corpus is read;
- a `.jsonl`/`.json`, `.parquet` or `.csv` file, a folder of one such kind or a glob: datasets' `json`, `parquet`
  or `csv` loader;
- a folder that `Dataset.save_to_disk` wrote (its `train` split, for a DatasetDict): `datasets.load_from_disk`;
- a hub dataset id (`org/name`): `datasets.load_dataset`, its `train` split, from the local cache when
  `HF_HUB_OFFLINE=1` (datasets' own offline mode).
A mixture (`a.jsonl:0.7,b.parquet:0.3`) is `datasets.interleave_datasets` with those probabilities and a seed:
the same rows in the same order on every layout and every resume (a map-style mixture is an ordinary Dataset; a
streamed one carries its position in `state_dict()`), stopping when the first source runs out.

`check_data_spec` reads nothing but names and is called when the config is made (a missing file or a bad weight is a
one-line error before any work); `read_data` reads.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from accel_trainer.contract.pretrained import is_hub_id
from accel_trainer.errors import ConfigError

LOADERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffixes to the datasets loader that reads them."""


@dataclass(frozen=True)
class Source:
    """One place rows come from: files of one loader, a save_to_disk folder or a hub id; its mixture weight."""

    where: str
    weight: float | None  # None: not given (a lone source, or equal weights)

    @property
    def kind(self) -> str:
        """ "files", "disk" (a save_to_disk folder) or "hub"."""
        path = Path(self.where).expanduser()
        if path.is_dir() and any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json")):
            return "disk"
        if path.exists() or glob.has_magic(self.where):
            return "files"
        return "hub"

    def files(self) -> tuple[str, list[str]]:
        """The loader's name and the files, sorted (a folder: its files of a known kind, recursively)."""
        path = Path(self.where).expanduser()
        if path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if p.suffix in LOADERS and p.is_file())
        elif path.is_file():
            found = [str(path)]
        else:
            found = sorted(p for p in glob.glob(os.path.expanduser(self.where), recursive=True) if Path(p).is_file())
        loaders = {LOADERS.get(Path(file).suffix) for file in found}
        if not found:
            raise ConfigError(f"data source {self.where}: no {'/'.join(LOADERS)} file there")
        if None in loaders or len(loaders) > 1:
            kinds = sorted({Path(file).suffix or "(none)" for file in found})
            raise ConfigError(
                f"data source {self.where} holds files of {len(kinds)} kinds ({', '.join(kinds)}): name one kind,"
                f" e.g. a glob such as {Path(self.where) / '*.jsonl'}, or list them as a mixture (a,b)"
            )
        return loaders.pop() or "", found


def parse_spec(spec: str) -> list[Source]:
    """The sources of a `data=` value, each with its weight (the part after the last ':' when it is a number).

    Raises:
        ConfigError: an empty part, a weight that is not a positive number, or weights on some parts only.
    """
    sources = []
    for part in spec.split(","):
        where, _, weight = part.strip().rpartition(":")
        if not where or not _number(weight):
            where, weight = part.strip(), ""
        if not where:
            raise ConfigError(f"data={spec!r} has an empty part: give WHERE[:WEIGHT] sources separated by commas")
        value = float(weight) if weight else None
        if value is not None and value <= 0:
            raise ConfigError(f"data source {where}: weight {weight} must be above 0")
        sources.append(Source(where, value))
    weighted = [source.weight is not None for source in sources]
    if any(weighted) and not all(weighted):
        raise ConfigError(f"data={spec!r}: give every source a weight, or none (equal weights)")
    return sources


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_data_spec(spec: str) -> str:
    """A `data=` value checked without reading rows: files named exist and have a known kind, a hub id is well
    formed (whether datasets finds it in its cache is known when it is read). Paths are made absolute, so the run's
    config names them from any folder.

    Raises:
        ConfigError: naming the source and the fix.
    """
    checked = []
    for source in parse_spec(spec):
        kind = source.kind
        where = source.where
        if kind == "files":
            source.files()
            if not glob.has_magic(where):
                where = str(Path(where).expanduser().resolve())
        elif kind == "disk":
            where = str(Path(where).expanduser().resolve())
        elif not is_hub_id(where) or Path(where).suffix in LOADERS:
            raise ConfigError(
                f"data source {where}: no such file or folder (nor a hub dataset id, which reads org/name)"
            )
        checked.append(where if source.weight is None else f"{where}:{source.weight:g}")
    return ",".join(checked)


def check_data(data: str, eval_data: str) -> tuple[str, str]:
    """A recipe's `data=` and `eval_data=` checked as `check_data_spec` checks each (empty: the recipe's own data).

    Raises:
        ConfigError: eval_data without data, or a spec's mistake.
    """
    if eval_data and not data:
        raise ConfigError("eval_data= is the held-out part of your own data=: give data= too")
    return (check_data_spec(data) if data else "", check_data_spec(eval_data) if eval_data else "")


def read_data(spec: str, columns: list[dict[str, str]], streaming: bool, seed: int, *, others: bool = False) -> Any:
    """The rows of a `data=` spec with the given columns only, renamed: `columns` lists the forms a source may
    take, each a map of new names to a source's column names (`[{"text": text_column}]` keeps the text column as
    "text"), and each source is read in the first form whose columns it has; with `others`, its other columns
    too (GRPO's reward functions read them). A `datasets.Dataset`, or an `IterableDataset` with `streaming`.

    Raises:
        ConfigError: a source in none of the forms (naming the columns it has), or one that cannot be read.
    """
    sources = parse_spec(spec)
    tables = [
        _columns(_read(source, streaming), _forms_of(source, columns), source.where, others) for source in sources
    ]
    if len(tables) == 1:
        return tables[0]
    weights = [source.weight or 1.0 for source in sources]
    probabilities = [weight / sum(weights) for weight in weights]
    return datasets.interleave_datasets(tables, probabilities=probabilities, seed=seed)


def _forms_of(source: Source, forms: list[dict[str, str]]) -> list[dict[str, str]]:
    """The column forms `source` is read in: a text file's rows are always in "text", whatever text_column names
    (the column of the other sources of a mixture)."""
    if source.kind == "files" and source.files()[0] == "text" and [list(form) for form in forms] == [["text"]]:
        return [{"text": "text"}]
    return forms


def _read(source: Source, streaming: bool) -> Any:
    """The source's rows as datasets reads them; a source that cannot be read or holds no row is one line."""
    unreadable = (OSError, ValueError, datasets.exceptions.DatasetNotFoundError, datasets.exceptions.DatasetBuildError)
    try:
        table = _loaded(source, streaming)
    except ConfigError:
        raise
    except unreadable as error:  # datasets' generation error says why in its cause (a JSON line that does not parse)
        raise ConfigError(
            f"data source {source.where} cannot be read: {_first_line(error.__cause__ or error)}"
        ) from None
    if not streaming and len(table) == 0:
        raise ConfigError(f"data source {source.where} holds no rows")
    return table


def _loaded(source: Source, streaming: bool) -> Any:
    if source.kind == "disk":
        loaded = datasets.load_from_disk(str(Path(source.where).expanduser()))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"]
        return loaded.to_iterable_dataset() if streaming else loaded
    if source.kind == "hub":
        return datasets.load_dataset(source.where, split="train", streaming=streaming)
    loader, files = source.files()
    if all(Path(file).stat().st_size == 0 for file in files):  # datasets' json reader stops on the first line
        raise ConfigError(f"data source {source.where} holds no rows")
    options = {"sample_by": "paragraph"} if loader == "text" else {}
    return datasets.load_dataset(loader, data_files=files, split="train", streaming=streaming, **options)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _columns(table: Any, forms: list[dict[str, str]], where: str, others: bool = False) -> Any:
    """`table` with the columns of its first form alone (and with `others`, the rest), each under its new name."""
    have = list(table.column_names or next(iter(table), {}))  # a stream of JSON may not know its columns yet
    columns = next((form for form in forms if all(column in have for column in form.values())), None)
    if columns is None:
        wanted = " or ".join("/".join(map(repr, form.values())) for form in forms)
        hint = ": name it with text_column=<column>" if [list(form) for form in forms] == [["text"]] else ""
        raise ConfigError(f"data source {where} has no column {wanted} (it has {', '.join(have)}){hint}")
    if not others:
        table = table.select_columns(list(columns.values()))
    renames = {old: new for new, old in columns.items() if old != new}
    return table.rename_columns(renames) if renames else table
