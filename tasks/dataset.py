"""A task over a local dataset of problems with reference answers (GSM8K-style files).

Rows come from JSON Lines, CSV, Parquet or a ``save_to_disk`` folder (:mod:`.dataset_io`); the
params name the fields: ``prompt_field`` (default ``question``), ``answer_field`` (default
``answer``), optionally ``id_field``, ``system_field`` and a job-wide ``system_prompt``.

Splits. The eval split is ``eval_path`` (another file), else ``eval_split`` (another split of a
``DatasetDict`` folder), else a held-out fraction ``eval_fraction`` of ``path``: a row is held out
when the sha256 of its *row key* falls below that fraction, so the split depends on nothing but
the key (not on row order, the seed, or rows added elsewhere in the file).

Row keys (:meth:`DatasetTask.row_id`): the value of ``id_field`` when the params name one (it
must be unique within its file), else ``<file name>#<row index>`` (0-based, blank JSON Lines
skipped); the index is only stable while the file's row order is.

Prompt ids. Training id ``p`` is row ``perm_e[p mod n]`` of the train split, with epoch
``e = p div n`` and ``perm_e`` a permutation seeded by (``seed``, ``e``) (the identity with
``shuffle = false``): every row once per epoch, in a fresh order each epoch. Held-out id
``EVAL_PROMPT_BASE + j`` is row ``j`` of the eval split.

Files are read once per process, on first use (the coordinator and the learner read them; nodes
receive prompt token ids in their leases and never need the dataset). ``make_task`` only checks
that the files exist.
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

import echo.tasks.rewards as rw
from echo.tasks.base import EVAL_PROMPT_BASE, Task, TaskParams, check_prompt_id
from echo.tasks.dataset_io import DatasetError, detect_format, read_rows


class DatasetParams(TaskParams):
    path: str = Field(min_length=1, description="the (train) dataset file or folder")
    format: Literal["auto", "jsonl", "csv", "parquet", "disk"] = "auto"
    split: str = Field("train", description="split of a DatasetDict folder")
    eval_path: str | None = None
    eval_split: str | None = None
    eval_fraction: float = Field(0.1, ge=0, le=0.9)
    prompt_field: str = "question"
    answer_field: str = "answer"
    id_field: str | None = None
    system_field: str | None = None
    system_prompt: str | None = Field(None, max_length=16384)
    prompt_template: str | None = Field(
        None, max_length=16384, description="text around the prompt; '{prompt}' marks where"
    )
    answer_after: str | None = Field(
        None,
        min_length=1,
        description="the answer is what follows the last such marker (GSM8K: '####')",
    )
    match: Literal["math", "exact", "number"] = Field("math", description="the task's own scorer")
    shuffle: bool = True
    seed: int = Field(0, ge=0, le=2**63 - 1)
    max_rows: int = Field(100_000, ge=1, le=10_000_000)
    max_file_mb: int = Field(1024, ge=1, le=65536)
    max_new_tokens: int = Field(512, ge=1, le=8192)

    @model_validator(mode="after")
    def _check(self) -> DatasetParams:
        if self.eval_path is not None and self.eval_split is not None:
            raise ValueError("give eval_path or eval_split, not both")
        if self.eval_path is None and self.eval_split is None and self.eval_fraction <= 0:
            raise ValueError("eval_fraction must be > 0 without eval_path or eval_split")
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template must contain '{prompt}'")
        return self


@dataclass(frozen=True)
class Row:
    key: str
    prompt: str
    answer: str
    system: str | None


@dataclass(frozen=True)
class Splits:
    train: list[Row]
    eval: list[Row]


_cache: dict[tuple[object, ...], Splits] = {}
_cache_lock = threading.Lock()


def _held_out(key: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return h < fraction * 2**64


class DatasetTask(Task):
    """Prompts and reference answers from a local file; the task's own reward is math-verify
    (``match = "math"``), the exact final answer (``match = "exact"``) or the last number
    (``match = "number"``), see
    :mod:`echo.tasks.rewards` for how the answer is taken from the completion."""

    name = "dataset"
    Params = DatasetParams
    params: DatasetParams

    def __init__(self, params: TaskParams) -> None:
        super().__init__(params)
        p = self.params
        # Cheap checks now (a missing file, an unknown suffix), reading on first use.
        fmt = detect_format(Path(p.path)) if p.format == "auto" else p.format
        if not Path(p.path).exists():
            raise DatasetError(f"dataset file {p.path} does not exist")
        if p.eval_path is not None:
            detect_format(Path(p.eval_path))
        if p.eval_split is not None and fmt != "disk":
            raise DatasetError(f"eval_split needs a save_to_disk folder; {p.path} is a file")
        self._perms: dict[int, list[int]] = {}
        self._splits: Splits | None = None

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    # ------------------------------------------------------------------ loading

    def load(self) -> Splits:
        """Both splits, read on the first call in this process and shared by equal tasks.

        :raises DatasetError: a file over a limit, malformed, lacking a field, with duplicate
            ids or without a marker ``answer_after`` names, or an empty split.
        """
        if self._splits is not None:
            # A task keeps the rows it first read: a job's prompts do not change under it, and
            # the scoring sandbox, which loads them before it loses the filesystem, needs no
            # file after that.
            return self._splits
        p = self.params
        files = [Path(f) for f in (p.path, p.eval_path) if f is not None]
        stamp = tuple((str(f.resolve()), f.stat().st_mtime_ns) for f in files)
        key = (p.model_dump_json(), stamp)
        with _cache_lock:
            splits = _cache.get(key)
            if splits is None:
                splits = self._read()
                _cache[key] = splits
        self._splits = splits
        return splits

    def _read(self) -> Splits:
        p = self.params
        fields = [p.prompt_field, p.answer_field]
        fields += [f for f in (p.id_field, p.system_field) if f and f not in fields]
        limits = {"max_rows": p.max_rows, "max_bytes": p.max_file_mb * 2**20}
        path = Path(p.path)
        train = self._rows(path, read_rows(path, p.format, fields, split=p.split, **limits))
        if p.eval_path is not None:
            epath = Path(p.eval_path)
            evals = self._rows(epath, read_rows(epath, "auto", fields, **limits))
        elif p.eval_split is not None:
            evals = self._rows(path, read_rows(path, "disk", fields, split=p.eval_split, **limits))
        else:
            evals = [r for r in train if _held_out(r.key, p.eval_fraction)]
            train = [r for r in train if not _held_out(r.key, p.eval_fraction)]
        for name, rows in (("train", train), ("eval", evals)):
            if not rows:
                raise DatasetError(f"dataset {p.path}: the {name} split is empty")
        return Splits(train, evals)

    def _rows(self, path: Path, raw: list[dict[str, str]]) -> list[Row]:
        p = self.params
        rows, seen = [], set()
        for i, r in enumerate(raw):
            key = r[p.id_field] if p.id_field else f"{path.name}#{i}"
            if key in seen:
                raise DatasetError(
                    f"dataset file {path}: id {key!r} ({p.id_field}) repeats",
                    public=f"dataset file {path}: row {i}: its id ({p.id_field}) repeats",
                )
            seen.add(key)
            answer = r[p.answer_field]
            if p.answer_after is not None:
                if p.answer_after not in answer:
                    raise DatasetError(
                        f"dataset file {path}: row {i}: {p.answer_field!r} has "
                        f"no {p.answer_after!r} marker (params.answer_after)"
                    )
                answer = answer.rsplit(p.answer_after, 1)[1]
            prompt = r[p.prompt_field]
            if p.prompt_template is not None:
                prompt = p.prompt_template.replace("{prompt}", prompt)
            system = (r.get(p.system_field) if p.system_field else None) or p.system_prompt
            rows.append(Row(key, prompt, answer.strip(), system))
        return rows

    # ------------------------------------------------------------------ prompt ids

    def _perm(self, epoch: int, n: int) -> list[int]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(n))
            if self.params.shuffle:
                seed = hashlib.sha256(f"{self.params.seed}|{epoch}".encode()).digest()
                random.Random(int.from_bytes(seed[:8], "little")).shuffle(perm)
            # Ids are leased in order: two epochs cover the one ending and the one starting.
            self._perms = {e: q for e, q in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return perm

    def row(self, prompt_id: int) -> Row:
        """The row behind ``prompt_id`` (see the module doc for the mapping).

        :raises TypeError, ValueError: a bad id, or a held-out id past the eval split.
        """
        check_prompt_id(prompt_id)
        splits = self.load()
        if prompt_id >= EVAL_PROMPT_BASE:
            j = prompt_id - EVAL_PROMPT_BASE
            if j >= len(splits.eval):
                raise ValueError(
                    f"prompt id {prompt_id} is past the eval split ({len(splits.eval)} rows)"
                )
            return splits.eval[j]
        epoch, pos = divmod(prompt_id, len(splits.train))
        return splits.train[self._perm(epoch, len(splits.train))[pos]]

    def eval_prompt_ids(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"n must be >= 0, not {n}")
        return list(range(EVAL_PROMPT_BASE, EVAL_PROMPT_BASE + min(n, len(self.load().eval))))

    def row_id(self, prompt_id: int) -> str:
        return self.row(prompt_id).key

    # ------------------------------------------------------------------ the task

    def prompt(self, prompt_id: int) -> str:
        return self.row(prompt_id).prompt

    def system_prompt(self, prompt_id: int) -> str | None:
        return self.row(prompt_id).system

    def answer(self, prompt_id: int) -> str:
        return self.row(prompt_id).answer

    def reward(self, prompt_id: int, completion: str) -> float:
        answer = self.answer(prompt_id)
        if self.params.match == "exact":
            return rw.exact_score(completion, answer)
        if self.params.match == "number":
            return rw.last_number_score(completion, answer)
        return rw.math_score(completion, answer)

    def format_example(self, rng: random.Random) -> tuple[str, str]:
        train = self.load().train
        # A real prompt with another row's answer: the right shape, not the right content.
        return rng.choice(train).prompt, rng.choice(train).answer
