"""Model exports the HTTP API serves: a published version as a Hugging Face folder.

:class:`Exports` owns ``<job dir>/exports/v<version>``: it writes a version's folder once, with
:func:`echo.learner.exports.export.export_version` (from the local learner's checkpoint, checked
against the state digest recorded when the version was published), and lists its files with their
sizes and sha256 so ``echo-job export`` can download and check each one. A LoRA job's version
exports as a peft adapter folder, or ``merged`` into its base as a plain Hugging Face folder
(``v<version>-merged``, :func:`echo.learner.exports.lora_merge.export_merged`). Writing runs in a
worker thread: a large model takes minutes and the API keeps answering meanwhile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from echo.coordinator.store import Store
from echo.protocol.jobspec import JobSpec

LISTING = "export.json"  # next to the folder: written last, so its presence means complete


class ExportUnavailable(LookupError):
    """The version cannot be exported; the message says why (for a 404 reply)."""


class Exports:
    """Export folders of the jobs under ``job_dir(job_id)``; see the module docstring."""

    def __init__(self, store: Store, job_dir: Any) -> None:
        self.store = store
        self.job_dir = job_dir
        self._locks: dict[tuple[str, int, bool], trio.Lock] = {}

    def folder(self, job_id: str, version: int, merged: bool = False) -> Path:
        """Where version ``version`` of ``job_id`` is exported (``merged``: a LoRA version's
        adapter merged into its base)."""
        return self.job_dir(job_id) / "exports" / f"v{version:08d}{'-merged' if merged else ''}"

    def _version(self, job_id: str, version: int | None) -> tuple[int, str]:
        row = self.store.job(job_id)
        if row is None:
            raise ExportUnavailable(f"no such job {job_id!r}")
        if row.current_version < 0:
            raise ExportUnavailable(f"job {job_id} has published no version yet")
        v = row.current_version if version is None else version
        rec = self.store.version(job_id, v)
        if rec is None:
            raise ExportUnavailable(
                f"job {job_id} has no version {v} (published: v0 to v{row.current_version})"
            )
        return v, rec.state_digest

    async def prepare(
        self, job_id: str, version: int | None, merged: bool = False
    ) -> dict[str, Any]:
        """Export ``version`` (None: the newest published; ``merged``: a LoRA job's adapter
        merged into its base) unless done before; returns
        ``{"job_id", "version", "merged", "files": [{"name", "size", "sha256"}]}``.

        :raises ExportUnavailable: unknown job or version, a version whose checkpoint the
            learner no longer keeps (or never wrote here: an external learner's), or
            ``merged`` for a job that is not a LoRA job.
        :raises OSError: the folder cannot be written.
        """
        v, digest = self._version(job_id, version)
        folder = self.folder(job_id, v, merged)
        listing = folder.parent / f"{folder.name}.{LISTING}"
        lock = self._locks.setdefault((job_id, v, merged), trio.Lock())
        async with lock:  # one writer per version; later callers reuse its result
            if not listing.exists():
                row = self.store.job(job_id)
                assert row is not None  # checked by _version
                spec = JobSpec.model_validate(row.spec)
                if merged and spec.lora is None:
                    raise ExportUnavailable(
                        f"job {job_id} is not a LoRA job: its export holds every weight "
                        "already (leave out --merged)"
                    )
                files = await trio.to_thread.run_sync(
                    self._write, self.job_dir(job_id), spec, v, digest, folder, merged
                )
                listing.write_text(json.dumps(files))
        files = json.loads(listing.read_text())
        return {"job_id": job_id, "version": v, "merged": merged, "files": files}

    @staticmethod
    def _write(
        job_dir: Path, spec: JobSpec, version: int, digest: str, folder: Path, merged: bool
    ) -> list[dict[str, Any]]:
        # Imported here: torch and transformers load only when a researcher exports.
        import shutil

        from echo.learner.exports.export import ExportError, export_version, file_list

        shutil.rmtree(folder, ignore_errors=True)  # a folder without listing is incomplete
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            if merged:
                from echo.learner.exports.lora_merge import export_merged

                export_merged(job_dir, spec, version, digest, folder)
            else:
                export_version(job_dir, spec, version, digest, folder)
        except ExportError as exc:
            raise ExportUnavailable(str(exc)) from None
        return file_list(folder)

    def file(self, job_id: str, version: int, name: str, merged: bool = False) -> Path | None:
        """The path of file ``name`` of a complete export, or None (unknown name, version not
        exported). Only names the listing holds are served: no path is built from ``name``
        otherwise."""
        folder = self.folder(job_id, version, merged)
        listing = folder.parent / f"{folder.name}.{LISTING}"
        try:
            names = {f["name"] for f in json.loads(listing.read_text())}
        except (OSError, ValueError):
            return None
        return folder / name if name in names else None
