"""Where data rows come from besides parquet files: a HF `datasets` directory, a dataset's
JSON / JSONL files, and a user's dataset class (verl's `data.custom_cls`). Every source gives
the same rows (dicts in the data schema, engine/data/prompts.py), so every dataset applies the
same row policy and error lines to them (engine/data/rows.py).

    a parquet file (or a directory of parquet files only)   read with pyarrow, as before
    a directory saved by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`   `datasets.load_from_disk`
    a dataset's directory of data files with split names (data/train-00000-of-00001.parquet,
    test.jsonl ...)                                                          `datasets.load_dataset(dir)`
    a .json / .jsonl file                                                    `datasets.load_dataset("json")`

A source with several splits gives the one `split` names (data.train_split / data.val_split; a
null val_split takes 'validation', else 'test'). The `datasets` package is an optional extra
(`pip install trident-rl[hf]`); without it such a source stops with one line naming it.

A custom dataset class (`data.custom_cls.path` / `.name`) is built as verl builds its RL dataset,
`cls(data_files=<the files>, tokenizer=<the tokenizer>, config=<the data section, a dict>)`, and
must be a sequence (`len`, `[i]`) of ROW DICTS in the data schema (`prompt`, `reward_model`,
`data_source`, `extra_info`): Trident tokenizes them itself. A verl class that returns tokenized
tensors (input_ids, attention_mask) is refused with one line.

Tests: tests/test_data_sources.py
"""
import importlib.util
import os
import re

from engine.errors import DataError

HF_HINT = "pip install trident-rl[hf]"
JSON_SUFFIXES = (".json", ".jsonl")
SPLIT_NAME = re.compile(r"(^|[-_./])(train|test|validation|valid|dev|eval)([-_./]|$)")

__all__ = ["Rows", "is_hf_source", "read_hf_rows", "custom_rows", "HF_HINT"]


class Rows(list):
    """Rows (dicts) with where they came from (`where`, for a row's error line)."""

    def __init__(self, rows, where=""):
        super().__init__(rows)
        self.where = where


def is_hf_source(path) -> bool:
    """Whether `path` is read with `datasets` (not pyarrow): a JSON file, a save_to_disk directory,
    or a directory holding data files other than parquet alone."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path.endswith(JSON_SUFFIXES)
    if not os.path.isdir(path):
        return False
    names = [os.path.relpath(os.path.join(d, n), path) for d, _, files in os.walk(path)
             for n in files if not n.startswith(".")]
    # parquet shards alone are one table (pyarrow); split names in them are a hub dataset's layout
    return not names or any(not n.endswith(".parquet") or SPLIT_NAME.search(n) for n in names)


def _datasets(key, path):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{key} {path!r} is a HF dataset (directory or JSON); reading it needs the "
                        f"`datasets` package: {HF_HINT} (or convert it to parquet)") from None
    return datasets


def _pick(found, split, key, path):
    """One split of a DatasetDict (`split` None: 'validation', else 'test', else the only one)."""
    names = list(found.keys())
    if split is None:
        split = next((s for s in ("validation", "test") if s in names), names[0] if len(names) == 1 else None)
        if split is None:
            raise DataError(f"{key} {path!r} holds the splits {names}; name one with data.val_split")
    if split not in names:
        raise DataError(f"{key} {path!r} has no split {split!r} (its splits: {names}); set "
                        f"data.{'train' if key.endswith('train_files') else 'val'}_split to one of them")
    return found[split]


def read_hf_rows(path, split=None, key="data.train_files"):
    """Rows of one HF source (see the module's table), in order; `split` picks a DatasetDict's."""
    path = os.fspath(path)
    datasets = _datasets(key, path)
    saved = os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                        for f in ("dataset_dict.json", "state.json"))
    try:
        if saved:
            found = datasets.load_from_disk(path)
        elif os.path.isfile(path):
            found = datasets.load_dataset("json", data_files=path, split="train")
        else:
            found = datasets.load_dataset(path)
    except (ValueError, OSError, datasets.exceptions.DatasetsError) as e:  # no data files, bad JSON
        cause = e.__cause__ or e  # DatasetGenerationError wraps the parser's error
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise DataError(f"{key} {path!r} could not be read as a HF dataset ({reason}); check the files "
                        "or convert them to parquet") from None
    if isinstance(found, (datasets.DatasetDict, dict)):
        found = _pick(found, split, key, path)
    return found.to_list()


def custom_rows(path, name, files, tokenizer, config):
    """Rows of a user's dataset class (see the module docstring), with where they came from."""
    key = "data.custom_cls.path"
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"{key}={path!r}: no such file; give the Python file that defines the class {name!r}")
    spec = importlib.util.spec_from_file_location(f"trident_custom_dataset_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, name or "", None)
    if not isinstance(cls, type):
        raise DataError(f"data.custom_cls.name={name!r}: {path!r} defines no class of that name; set it to "
                        "the dataset class")
    try:
        dataset = cls(data_files=list(files), tokenizer=tokenizer, config=dict(config))
    except TypeError as e:
        raise DataError(f"data.custom_cls.name={name!r}: {name}(data_files=..., tokenizer=..., config=...) "
                        f"failed ({e}); the class must take those three keyword arguments") from None
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise DataError(f"data.custom_cls.name={name!r}: an instance has no len() / [i]; the class must be a "
                        "sequence of row dicts (a torch Dataset is)")
    rows = [dataset[i] for i in range(len(dataset))]
    for i, row in enumerate(rows[:1]):
        if not isinstance(row, dict) or "input_ids" in row and "prompt" not in row:
            shown = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"data.custom_cls.name={name!r}: item {i} is {shown}, tokenized or not a dict; "
                            "Trident's dataset class returns rows in the data schema (prompt, reward_model, "
                            "data_source, extra_info) and tokenizes them itself")
    return Rows(rows, where=f" of {name}({', '.join(repr(os.fspath(f)) for f in files)})")


def rows_or_files(files, split=None, key="data.train_files", custom=None, tokenizer=None, config=None):
    """What a dataset is built from: the files themselves when they are all parquet (read by the
    dataset, as before), else Rows from the HF reader or the user's class (`custom`: (path, name))."""
    files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if custom is not None and custom[0]:
        return custom_rows(custom[0], custom[1], files, tokenizer, config or {})
    if not any(is_hf_source(f) for f in files):
        return files
    rows = []
    for f in files:
        if is_hf_source(f):
            rows.extend(read_hf_rows(f, split, key))
        else:
            from engine.data.prompts import read_parquet
            rows.extend(read_parquet(f).to_pylist())
    return Rows(rows, where=f" of {', '.join(repr(os.fspath(f)) for f in files)}")
