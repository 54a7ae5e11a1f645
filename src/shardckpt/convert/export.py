"""Export one committed step to one file of full tensors (safetensors or torch).

For inference and for tools that do not speak DCP: the module saved under one
state key becomes a flat ``{fqn: tensor}`` file whose keys are exactly those
of ``model.state_dict()`` of the unwrapped module, each tensor whole, however
many ranks saved it and however it was sharded (FSDP2 / DTensor).

The order of the work, for a local directory and a remote URL alike::

    locate the step (default: the newest live step, see shardckpt.format.lineage)
      -> .metadata: verified (local) or fetched and verified (remote), then
         parsed with the restricted unpickler (no code from the checkpoint runs)
      -> plan: the module key (and the optimizer paired with it), the items to
         export, and the shard files that hold them (metadata.storage_data)
      -> those files only: verified against the manifest (local), or fetched
         into a temporary directory, each verified while downloading (remote)
      -> DCP's own loader reads each item whole into a tensor allocated from
         the saved size and dtype, and the file is written under a temporary
         name, checked, and renamed into place.

safetensors is written by streaming: the header (names, dtypes, shapes,
offsets) comes from the metadata alone, then tensors are read and written in
batches of at most ``batch_bytes`` (a larger tensor is a batch by itself), so
the memory held is one batch, never the model. The torch format is one
``torch.save`` of a dict: the model is in memory once.

With ``optimizer=True`` the optimizer's tensors are added under
``optimizer.<saved name without the optimizer key>`` (``optimizer.state.
fc1.weight.exp_avg``); its non-tensor values (param groups, counters saved as
plain numbers) go, as one nested structure of plain types, into the
safetensors header metadata as JSON under ``"optimizer"``, or into the torch
file under the key ``"optimizer"``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
from typing import Callable

from shardckpt import steps as steps_mod
from shardckpt import stores
from shardckpt._text import fmt_bytes
from shardckpt.convert.export_plan import (
    DEFAULT_BATCH_BYTES,
    FORMATS,
    ExportJob,
    ExportResult,
    ExportSource,
    make_plan,
)
from shardckpt.convert.export_write import write_export
from shardckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ExportIOError,
    ShardckptError,
)
from shardckpt.format import layout, lineage
from shardckpt.remote import commit as remote_commit

log = logging.getLogger("shardckpt")

# ---------------------------------------------------------------- entry point


def export_step(
    src: str,
    out: str,
    *,
    step: int | None = None,
    fmt: str = "safetensors",
    optimizer: bool = False,
    key: str | None = None,
    trust_pickles: bool = False,
    endpoint_url: str | None = None,
    transfer: stores.TransferOptions | None = None,
    progress: Callable[[int], None] | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> ExportResult:
    """Write step ``step`` of ``src`` (default: the newest live step) to the file ``out``.

    ``src``: a checkpoint directory (a Checkpointer's ``local_dir``, or one
    ``step_<N>`` directory in it) or a remote URL (``s3://bucket/prefix``,
    ``file:///path``); from a remote only the files holding exported items are
    downloaded. ``key`` chooses the module when the step holds several.
    ``progress(n)`` is called (from any thread) with each increment of bytes
    downloaded and of tensor bytes exported. Tensors are read and written in
    batches of at most ``batch_bytes`` (safetensors). ``trust_pickles`` lifts
    the restricted unpickling of the metadata and of non-tensor items, only for
    checkpoints whose origin you trust. Raises a :class:`ShardckptError`.
    """
    if fmt not in FORMATS:
        raise ConfigError(
            f"unknown export format {fmt!r} for {out}; choose one of: {', '.join(FORMATS)} (--format)"
        )
    if batch_bytes < 1:
        raise ConfigError(f"batch_bytes must be >= 1, got {batch_bytes!r}")
    out = os.path.abspath(out)
    out_dir = os.path.dirname(out)
    if not os.path.isdir(out_dir):
        raise ConfigError(f"cannot export to {out}: the directory {out_dir} does not exist. Remedy: create it first.")
    if os.path.isdir(out):
        raise ConfigError(f"cannot export to {out}: it is a directory. "
                          f"Remedy: name the file to write, e.g. {out}/model.{_suffix(fmt)}.")
    report = _locked(progress)
    job = ExportJob(out=out, fmt=fmt, optimizer=optimizer, key=key, trust=trust_pickles, progress=report,
                    batch_bytes=batch_bytes)
    try:
        if "://" not in src:
            return _export_local(src, step, job)
        options = transfer or stores.TransferOptions()
        if endpoint_url is not None:
            options = dataclasses.replace(options, endpoint_url=endpoint_url)
        return _export_remote(src, step, job, options)
    except ShardckptError:
        raise
    except OSError as exc:
        which = f"step {step}" if step is not None else "the newest step"
        raise ExportIOError(
            f"export of {which} of {stores.safe_url(src)} to {out} failed: {stores.redact(str(exc))}. "
            f"Remedy: check the free space and permissions of {out_dir} (and that {stores.safe_url(src)} is readable)."
        ) from exc


def _suffix(fmt: str) -> str:
    return "safetensors" if fmt == "safetensors" else "pt"


def _locked(progress: Callable[[int], None] | None) -> Callable[[int], None]:
    """``progress`` called under a lock (downloads report from several threads)."""
    if progress is None:
        return lambda _n: None
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            progress(n)

    return report


# ---------------------------------------------------------------- locating the step


EXPORT_REMEDY = "Remedy: pick a committed step (shardckpt ls), or leave out --step for the newest live one."


def _choose_step(infos: dict[int, lineage.StepInfo], step: int | None, where: str) -> int:
    return steps_mod.choose_step(infos, step, where, EXPORT_REMEDY)


def _export_local(src: str, step: int | None, job: ExportJob) -> ExportResult:
    if os.path.isfile(os.path.join(src, layout.MANIFEST_NAME)):  # one step directory
        step_dir = src
        manifest = layout.read_manifest(step_dir)
        _choose_step({manifest.step: lineage.info_of(manifest)}, step, src)
        view = steps_mod.StepView(stores.LocalDirStore(step_dir), manifest, prefix="")
    else:
        step = _choose_step(lineage.local_infos(src), step, src)
        step_dir = os.path.join(src, layout.step_dirname(step))
        manifest = layout.read_manifest(step_dir)
        if manifest is None:  # deleted since it was listed
            raise CheckpointNotFoundError(f"step {step} is no longer committed in {src}. Remedy: run the export again.")
        view = steps_mod.StepView(stores.LocalDirStore(src), manifest)

    def verify(names: list[str]) -> None:
        try:
            view.verify(names)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"cannot export step {manifest.step} from {src}: {exc} Or export another step with --step."
            ) from exc

    result = export_dir(step_dir, manifest, src, verify, job)
    result.source = src
    result.step_files, result.step_bytes = _step_size(manifest)
    return result


def _export_remote(src: str, step: int | None, job: ExportJob, options: stores.TransferOptions) -> ExportResult:
    store = stores.open_store(src, options)
    where = stores.safe_url(src)
    try:
        step, manifest = steps_mod.remote_step(store, step, where, EXPORT_REMEDY,
                                               stores.Deadline(options.step_deadline_s))
        view = steps_mod.StepView(store, manifest)
        tmp = tempfile.mkdtemp(prefix=f".shardckpt-export-{step}-", dir=os.path.dirname(job.out))
        fetched: list[str] = []
        try:
            def fetch(names: list[str]) -> None:
                total = sum(manifest.files[n].size for n in names)
                what = f"fetching {len(names)} file(s) of step {step} from {where} for export"
                with remote_commit.Progress(what, total, remote_commit.PROGRESS_S) as bar:
                    def report(n: int) -> None:
                        bar.add(n)
                        job.progress(n)

                    view.fetch_into(tmp, names, report)
                fetched.extend(names)

            result = export_dir(tmp, manifest, where, fetch, job)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        store.close()
    result.source = where
    result.fetched_files = len(fetched)
    result.fetched_bytes = sum(manifest.files[n].size for n in fetched)
    result.step_files, result.step_bytes = _step_size(manifest)
    log.info(
        "shardckpt: export of step %d fetched %d of %d file(s) (%s of %s) from %s",
        result.step, result.fetched_files, result.step_files, fmt_bytes(result.fetched_bytes),
        fmt_bytes(result.step_bytes), where,
    )
    return result


def _step_size(manifest: layout.Manifest) -> tuple[int, int]:
    return len(manifest.files), sum(e.size for e in manifest.files.values())


def export_dir(
    step_dir: str, manifest: layout.Manifest, where: str, obtain: Callable[[list[str]], None], job: ExportJob
) -> ExportResult:
    """Export from ``step_dir`` once ``obtain(names)`` made each named file present and verified."""
    src = ExportSource(step_dir, manifest, where, obtain, job.trust)
    plan = make_plan(src, job)
    src.need(plan.files)  # all at once: a remote fetches them concurrently
    return write_export(src, plan, job)
