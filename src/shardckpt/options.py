"""Configuration: one keyword-only dataclass, every field documented.

``CheckpointConfig.from_env()`` reads the same fields from ``SHARDCKPT_*``
environment variables (``SHARDCKPT_LOCAL_DIR``, ``SHARDCKPT_KEEP_LAST``, ...),
which is how the module-level default instance is configured when
``shardckpt.init()`` is not called.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import signal
from typing import Any

from shardckpt.check_resume import probe as resume_probe
from shardckpt.errors import ConfigError
from shardckpt.format import codec
from shardckpt.stores import TransferOptions

MICRO_BATCH_KEY = "shardckpt.micro_batch_size"
ACCUM_KEY = "shardckpt.grad_accum_steps"
"""Manifest metadata keys of the batch shape a run saved with (read by the elastic plan)."""


class SaveMode(str, enum.Enum):
    """How ``save()`` writes: ``async`` returns after staging, ``sync`` after commit."""

    ASYNC = "async"
    SYNC = "sync"


class OnDiskFull(str, enum.Enum):
    """What a save does when the local tier lacks the space it needs."""

    ERROR = "error"
    SKIP = "skip"


class UploaderMode(str, enum.Enum):
    """Who uploads committed steps when ``remote`` is set.

    ``auto``: local rank 0 of each node starts ``shardckpt sync`` in its own
    process (it outlives the trainer); ``external``: a sidecar or systemd unit
    runs it (``close()`` still waits for it to drain); ``off``: nothing is
    uploaded, the remote is only read (restore).
    """

    AUTO = "auto"
    EXTERNAL = "external"
    OFF = "off"


class OnRemoteUnavailable(str, enum.Enum):
    """What happens when the remote cannot be listed or written at the first save or load."""

    ERROR = "error"
    WARN = "warn"


class OnCorrupt(str, enum.Enum):
    """What ``load()`` does when a committed step fails verification."""

    ERROR = "error"
    FALLBACK = "fallback"


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Everything a :class:`shardckpt.Checkpointer` can be told."""

    local_dir: str = "checkpoints"
    """Fast tier (node-local NVMe or any local path). One sub-directory per step.
    In a run made by ``shardckpt check-resume`` it points into the check's own directory, whatever is given."""

    remote: str | None = None
    """Optional remote tier, any fsspec URL (``s3://bucket/prefix``, ``file:///mnt/nfs/run``).
    In a run made by ``shardckpt check-resume`` a ``file://`` directory of the check, whatever is given."""

    every_steps: int | None = None
    """Save when ``step % every_steps == 0``. ``None`` with ``every_seconds`` also
    ``None`` saves at every call."""

    every_seconds: float | str | None = None
    """Save when at least this many seconds passed since the last save started
    (decided on rank 0 and agreed by all ranks). ``"auto"`` (with ``mtbf_s``)
    picks the interval that minimises checkpoint overhead plus expected lost
    work from the cost this job measures: ``sqrt(2 * blocked time * mtbf_s)``."""

    mtbf_s: float | None = None
    """With ``every_seconds="auto"``: the mean time between failures or preemptions
    you expect (e.g. 3600 for a spot pool), in seconds."""

    keep_last: int | None = 3
    """Retention: keep the newest N committed steps (N >= 1). ``None`` keeps all."""

    keep_every: int | None = None
    """Retention: additionally keep every step that is a multiple of this."""

    keep_best: int | None = None
    """Retention: also keep the K best steps by ``best_metric`` (recorded with
    ``save(..., metrics={...})``), on both tiers; never purged by the other policies."""

    best_metric: str | None = None
    """The metric that ranks steps for ``keep_best`` and ``load(state, step="best")``."""

    best_mode: str = "min"
    """``min`` (lower is better, e.g. a loss) or ``max`` (e.g. an accuracy)."""

    full_every: int | None = None
    """Every N-th save is full, the others light (model weights and the small
    state: sampler, RNG, plain values, schedulers; no optimizer state). ``None``:
    every save is full. A preemption save is always full."""

    keep_last_light: int | None = None
    """Retention of light steps (``keep_last`` counts full steps only); ``None``: as ``keep_last``."""

    trainable_only: bool = False
    """Save only the parameters that require grad (and their optimizer state, the
    buffers of modules that have trainable parameters, and the rest of the state):
    a frozen base with small adapters saves the adapters. The manifest records the
    frozen keys left out (names, shapes, a fingerprint) and ``load()`` checks the
    base it loads into against them."""

    run_config: Any = None
    """What was this run: a dict, or the path of a YAML/JSON file whose content is
    recorded. Every manifest stores it with the command line, world size, device
    and versions; ``load()`` warns when the current one differs (keys old -> new;
    those that can change shapes first)."""

    run_config_ignore: tuple[str, ...] = ()
    """Keys of ``run_config`` left out of that comparison: dotted names or shell-style
    patterns (``"out_dir"``, ``"wandb.*"``, ``"*_path"``); a name also covers the keys
    under it. For entries that differ on every resume (paths, run names, timestamps).
    ``SHARDCKPT_RUN_CONFIG_IGNORE``: comma-separated."""

    memory_every_steps: int | None = None
    """The memory tier: keep the step in shared memory (``/dev/shm``) every N steps; ``None``
    (default): off. The staging copy ``save()`` makes anyway goes there, so such a save costs
    the loop that copy (no disk write), and it survives the trainer: a process killed right after ``save()``
    returned is resumed from it by the next launch on the machine, in about the time of one copy. Saves due on disk
    (``every_steps``, ``every_seconds``) are kept in memory too and written from the same buffers.
    Host memory: ``memory_keep + 1`` copies of the staged state per rank (3 with ``memory_keep=1``). The
    copies belong to the directory's run (``<local_dir>/.shardckpt-run``), never to its path; a problem
    with shared memory makes the tier step aside with one warning, the disk saves go on. ``close()`` writes a
    step newer in memory than on disk to disk, then frees the memory; after a crash the node's
    memory keeper frees it once no trainer is left for ``SHARDCKPT_MEMORY_LINGER_S`` (120 s).
    When to turn it on: docs/guides/memory-tier.md."""

    memory_keep: int = 1
    """Steps each rank keeps in memory (the newest ones); one more slot takes the next copy, so that
    a process killed while it copies leaves the newest save that returned usable (with 1, a third slot,
    laid out only when a memory save comes while a disk write runs)."""

    memory_budget: float | None = None
    """Shared memory the memory tier may use per machine, for all its ranks: a fraction of the host's
    RAM (``0 < x <= 1``) or a number of bytes (``> 1``); ``None``: 0.5 of the RAM. A state that does not
    fit (``(memory_keep + 1)`` x its staged bytes, 3x with ``memory_keep=1``) makes the tier step aside at the
    first save, with a warning saying how much it needs (the disk saves go on); so does a ``/dev/shm`` too
    small (``SHARDCKPT_SHM_DIR``: another tmpfs)."""

    mode: SaveMode = SaveMode.ASYNC
    """``async`` (default): block only while staging into host memory."""

    capture_rng: bool = True
    """Save and restore per-rank RNG state (python, numpy, torch CPU, CUDA)."""

    strict: bool = True
    """Loading raises on missing or unexpected keys; ``False`` logs and skips them."""

    on_disk_full: OnDiskFull = OnDiskFull.ERROR
    """``error``: the save raises :class:`InsufficientSpaceError`; ``skip``: warn and skip it."""

    free_space_margin: float = 0.05
    """Extra fraction of the expected size that must be free before a save starts."""

    on_corrupt: OnCorrupt = OnCorrupt.ERROR
    """``fallback``: a step failing verification (or a newest step that cannot be assembled,
    e.g. a node's disk is gone) is skipped for the previous one, with a warning."""

    start_fresh: bool = False
    """Begin a new history deliberately although committed steps exist: ``load()`` returns
    ``None`` instead of raising when the newest step cannot be assembled (a node's files are
    gone), and the first save does not refuse a remote that holds another history's steps.
    Locally no existing step is deleted by it: an earlier save of a step number is kept aside
    (``shardckpt gc`` removes it). On the remote, which holds one save per number, a step of
    the same number as a new save is replaced by it. Default ``False``: those cases raise,
    naming what exists."""

    verify_on_load: bool = True
    """Check every file of the step against the manifest's checksum before loading."""

    preemption_signals: tuple[int, ...] = (signal.SIGTERM,)
    """Signals that make the next ``save()`` save at once and wait for the commit."""

    pin_memory: bool | None = None
    """Pin the host staging buffers; ``None`` pins when CUDA is available."""

    max_pinned_bytes: int | None = None
    """Pin at most this many bytes of staging buffers per rank (``None``: all); the
    rest is pageable, for hosts that cannot pin the whole state: its copies are
    synchronous, so a save blocks longer."""

    overlap_copies: bool = False
    """On a GPU, let ``save()`` return once the device-to-host copies into the
    staging buffers are *enqueued* (on a side stream), so that the next step
    runs beside them. ``False`` (default): ``save()`` returns when the copies
    are complete, and no write after it can reach them (on an H200 that
    blocked 1.02x as long as a bare copy into pinned buffers). On a CPU the
    copies are always complete when ``save()`` returns.

    With ``True`` only these writes wait for the copies (on the GPU, without
    blocking the CPU): ``step()`` of an optimizer that is a top-level value of
    the state passed to ``save()`` (a step pre-hook added at its first save:
    step pre-hooks added before it run unfenced), and the forward of every
    submodule that owns buffers, of a module that is a top-level value (a
    forward pre-hook added at the first save). Not fenced, so each may be
    copied half-written: schedule-free optimizers' ``train()``/``eval()``; EMA
    weights swapped in or out; SAM's ``first_step``; ``load_state_dict``,
    ``p.copy_()`` or any in-place write under ``no_grad`` before ``step()``;
    DDP's buffer broadcast (``broadcast_buffers=True``, before any submodule
    hook) and forward pre-hooks added before ours (legacy ``spectral_norm``);
    an optimizer that is not a top-level value of the state (a second one, or
    one stepped in backward hooks); a step replayed from a CUDA graph; CUDA
    tensors inside plain values; work on other streams. Call
    ``Checkpointer.wait_for_copies()`` before such a write.

    A violation is detected where the tensor's version counter shows it: every
    source tensor's ``_version`` is recorded at ``save()`` and compared at the
    first fenced write (or when the copies end, if earlier); a change fails the
    step with :class:`SaveError` naming the tensor (nothing of it is committed;
    earlier steps are intact). It is not re-copied: the state has moved on. Not
    seen by the counter: writes through ``.data``, inside kernels that update
    their arguments in place without it (BatchNorm's running statistics in
    the forward, collectives such as ``dist.broadcast``), CUDA-graph replays,
    tensors inside plain values, and writes on other streams after the first
    fenced write. A write queued before the first fenced write fails the step
    even when the GPU happened to finish the copy before it ran."""

    io_threads: int = 2
    """Threads per rank writing shard files (DCP's ``thread_count``)."""

    collective_timeout_s: float = 1800.0
    """Timeout of the side process groups that background work uses."""

    save_agree_timeout_s: float | None = 300.0
    """How long a ``save()`` call waits for every rank to call ``save()`` too before
    it issues any collective (a check-in through the default group's store). A
    rank that does not arrive in time (``save()`` called under ``if rank == 0:``)
    makes the call raise :class:`SaveError` on the ranks that called, naming the
    ranks that did not, instead of a collective hanging for ``collective_timeout_s``.
    Raise it when one rank legitimately reaches ``save()`` much later than the
    others (e.g. evaluating alone first: the default of 5 minutes leaves room for
    that, and the waiting ranks log a line after 10 s); ``None`` skips the check-in."""

    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """User metadata recorded in every manifest (JSON-serialisable)."""

    run_id: str | None = None
    """Names the training run. Recorded in every manifest; ``load()`` refuses a step
    that another run wrote (``None`` records nothing and accepts any step)."""

    # ---- remote tier (used only when ``remote`` is set)

    uploader: UploaderMode = UploaderMode.AUTO
    """``auto`` starts one uploader process per node; ``external`` expects a
    ``shardckpt sync`` sidecar; ``off`` never uploads (restore only)."""

    on_remote_unavailable: OnRemoteUnavailable = OnRemoteUnavailable.ERROR
    """At the first save or load the remote is listed and (when this job uploads) a small probe
    object written and deleted. ``error``: a failure raises :class:`RemoteError` with the remedy
    (a typo'd bucket or endpoint must not let a long run go on without a copy in the remote);
    ``warn``: log it and go on with the local tier (uploads are retried)."""

    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, Ceph RGW, ...); ``None`` uses ``AWS_ENDPOINT_URL``
    or AWS. Credentials always come from the standard boto3 chain."""

    remote_keep_last: int | None = None
    """Remote retention: keep the newest N steps committed there (N >= 1); ``None`` keeps all."""

    remote_keep_every: int | None = None
    """Remote retention: additionally keep every step that is a multiple of this."""

    remote_every: int | None = None
    """Upload only every M-th committed step (the first one, then every M-th; the
    rest stay local and rotate out), bounding what the remote costs while local
    steps stay frequent. A save triggered by a preemption signal is always uploaded."""

    transfer_concurrency: int = 8
    """Requests in flight per node for uploads and restores (across files and parts)."""

    part_size: int = 32 << 20
    """Multipart part / ranged-GET size in bytes; files of at least twice this go multipart."""

    request_timeout_s: float = 60.0
    """Timeout of one remote request (a stalled request is retried)."""

    remote_max_attempts: int = 8
    """Attempts per remote request on throttling, 5xx and connection errors (first included)."""

    remote_compression: str = "auto"
    """Lossless compression of what the uploader sends: ``auto`` compresses files of 8 MiB and more
    when this node compresses clearly faster than its link uploads (measured as the uploader starts,
    before its first upload; kept per bucket and endpoint on the node for 12 h; said in its log),
    ``off`` never, ``bytegroup-zstd`` always. Each 4 MiB chunk is compressed on its own (bytes
    regrouped by their place in a value, then zstd; stored raw when it does not shrink) while the
    chunks before it upload, so ranged restores still fetch only what they need; checksums stay on
    the uncompressed bytes, and each stored chunk's checksum is checked before it is decompressed.
    The local tier and peer replicas keep the files as written."""

    backoff_max_s: float = 10.0
    """Cap of the exponential backoff between attempts."""

    step_deadline_s: float = 1800.0
    """Upload or download of one step gives up after this long (an upload is retried later)."""

    remote_commit_timeout_s: float = 1800.0
    """A step not committed remotely this long after its save is reported failed: a warning in
    the trainer's log and ``status()["failed_commits"]``, naming the ranks (and nodes) whose files
    are missing. The step stays pending (it can still commit late, or a newer committed step
    supersedes it); later steps commit as usual, and the newest committed step stays the newest."""

    drain_timeout_s: float = 120.0
    """``close()`` waits at most this long for this node's uploads to be committed remotely.
    The default fits AWS's 2-minute spot notice; the uploader goes on after the process exits
    (while the machine lives), and close() says what is still pending."""

    peer_replicas: int | None = None
    """Copies of each node's files of a step kept on other nodes (the peer tier): after each
    local commit the node's peer daemon sends them to the next nodes on a ring, off the node's
    ``SHARDCKPT_FAILURE_DOMAIN``. ``None``: 1 when the job spans >= 2 nodes with node-local
    directories, else 0; ``0`` turns the tier off."""

    peer_bandwidth: int | None = None
    """Cap of the replication traffic each node sends, in bytes per second (``None``: unlimited)."""

    peer_tls_ca: str | None = None
    """Path of an operator's CA certificate (PEM) for the peer tier's mutual TLS
    (``SHARDCKPT_PEER_TLS_CA``). With ``peer_tls_cert`` and ``peer_tls_key``, a peer is trusted
    when its certificate chains to this CA, and no node makes its own key. ``None`` (default):
    each node makes its own key pair on its first launch and the job pins the nodes' certificates."""

    peer_tls_cert: str | None = None
    """Path of this node's certificate (PEM) issued by ``peer_tls_ca`` (``SHARDCKPT_PEER_TLS_CERT``)."""

    peer_tls_key: str | None = None
    """Path of this node's private key (PEM, unencrypted, mode 0600) (``SHARDCKPT_PEER_TLS_KEY``)."""

    micro_batch_size: int | None = None
    """Per-rank micro-batch of this run. When set, every manifest records it (and
    ``grad_accum_steps``) so that an elastic restore at another world size can
    recompute accumulation or scale the learning rate; see ``shardckpt.restoring.elastic``."""

    grad_accum_steps: int = 1
    """Gradient accumulation steps per optimizer step of this run (with
    ``micro_batch_size``). An elastic restore updates both to its plan."""

    def __post_init__(self) -> None:
        if not self.local_dir:
            raise ConfigError("local_dir must name a directory")
        self.local_dir = os.fspath(self.local_dir)
        # Under `shardckpt check-resume` (only there) both point into the check's own directory, whatever was given.
        self.local_dir, self.remote = resume_probe.redirect(self.local_dir, self.remote)
        for name in ("every_steps", "keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ConfigError(
                f"keep_last must be >= 1 (at least one committed step always survives) or None, "
                f"got {self.keep_last!r}"
            )
        if self.every_seconds == "auto":
            if not isinstance(self.mtbf_s, (int, float)) or not self.mtbf_s > 0:
                raise ConfigError(
                    f"every_seconds='auto' needs mtbf_s, the mean time between failures in seconds (e.g. 3600), "
                    f"got mtbf_s={self.mtbf_s!r}"
                )
        elif self.every_seconds is not None and (
            isinstance(self.every_seconds, (str, bool)) or not self.every_seconds > 0
        ):
            raise ConfigError(f"every_seconds must be > 0, 'auto' or None, got {self.every_seconds!r}")
        for name in ("keep_best", "full_every", "keep_last_light", "remote_every", "memory_every_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
        if isinstance(self.memory_keep, bool) or not isinstance(self.memory_keep, int) or self.memory_keep < 1:
            raise ConfigError(f"memory_keep must be an integer >= 1, got {self.memory_keep!r}")
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool)
                                               or not isinstance(self.memory_budget, (int, float))
                                               or not self.memory_budget > 0):
            raise ConfigError(f"memory_budget must be a fraction of the host's RAM (0 < x <= 1), a number of bytes "
                              f"(> 1) or None, got {self.memory_budget!r}")
        if self.keep_best is not None and not self.best_metric:
            raise ConfigError("keep_best needs best_metric, the name of a metric passed to save(..., metrics={...})")
        if self.best_mode not in ("min", "max"):
            raise ConfigError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if not 0 <= self.free_space_margin < 10:
            raise ConfigError(f"free_space_margin must be in [0, 10), got {self.free_space_margin!r}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads!r}")
        for name in ("remote_keep_last", "remote_keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.transfer_concurrency, int) or self.transfer_concurrency < 1:
            raise ConfigError(f"transfer_concurrency must be >= 1, got {self.transfer_concurrency!r}")
        if not isinstance(self.part_size, int) or self.part_size < (5 << 20):
            raise ConfigError(f"part_size must be at least 5 MiB (S3's minimum part), got {self.part_size!r}")
        if not isinstance(self.remote_max_attempts, int) or self.remote_max_attempts < 1:
            raise ConfigError(f"remote_max_attempts must be >= 1, got {self.remote_max_attempts!r}")
        if self.remote_compression not in codec.MODES:
            raise ConfigError(f"remote_compression must be one of {', '.join(codec.MODES)}, "
                              f"got {self.remote_compression!r}")
        for name in ("request_timeout_s", "backoff_max_s", "step_deadline_s", "drain_timeout_s",
                     "remote_commit_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s!r}")
        if self.save_agree_timeout_s is not None and (
            isinstance(self.save_agree_timeout_s, bool) or not isinstance(self.save_agree_timeout_s, (int, float))
            or not self.save_agree_timeout_s > 0
        ):
            raise ConfigError(f"save_agree_timeout_s must be > 0 or None, got {self.save_agree_timeout_s!r}")
        for name, enum_type in (
            ("mode", SaveMode),
            ("on_disk_full", OnDiskFull),
            ("on_corrupt", OnCorrupt),
            ("uploader", UploaderMode),
            ("on_remote_unavailable", OnRemoteUnavailable),
        ):
            value = getattr(self, name)
            try:
                setattr(self, name, enum_type(value))
            except ValueError:
                allowed = ", ".join(e.value for e in enum_type)
                raise ConfigError(f"{name} must be one of {allowed}, got {value!r}") from None
        self.preemption_signals = tuple(int(s) for s in self.preemption_signals)
        ignore = (self.run_config_ignore,) if isinstance(self.run_config_ignore, str) else self.run_config_ignore
        if not isinstance(ignore, (list, tuple)) or not all(isinstance(p, str) and p for p in ignore):
            raise ConfigError(f"run_config_ignore must be a list of key names or patterns, "
                              f"got {self.run_config_ignore!r}")
        self.run_config_ignore = tuple(ignore)
        if self.peer_replicas is not None and (
            isinstance(self.peer_replicas, bool) or not isinstance(self.peer_replicas, int) or self.peer_replicas < 0
        ):
            raise ConfigError(f"peer_replicas must be an integer >= 0 (0: no peer tier) or None, "
                              f"got {self.peer_replicas!r}")
        if self.peer_bandwidth is not None and (
            isinstance(self.peer_bandwidth, bool) or not isinstance(self.peer_bandwidth, int) or self.peer_bandwidth < 1
        ):
            raise ConfigError(f"peer_bandwidth must be a positive number of bytes per second or None, "
                              f"got {self.peer_bandwidth!r}")
        for name in ("micro_batch_size", "grad_accum_steps"):
            value = getattr(self, name)
            if (value is not None or name == "grad_accum_steps") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.micro_batch_size is not None:
            self.metadata = dict(self.metadata)
            record_shape(self, self.micro_batch_size, self.grad_accum_steps)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> "CheckpointConfig":
        """Build a config from ``SHARDCKPT_<FIELD>`` variables; ``overrides`` win.

        The one rule of every entry point (``Checkpointer(**fields)``,
        ``shardckpt.init(**fields)``, the module-level default instance):
        explicit arguments, then ``SHARDCKPT_*``, then the defaults.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get("SHARDCKPT_" + field.name.upper())
            if raw is None or field.name == "metadata":
                continue
            values[field.name] = _parse_env(field.name, raw)
        values.update(overrides)
        return cls(**values)

    def transfer_options(self) -> Any:
        """The remote tier's :class:`shardckpt.stores.network.TransferOptions` for this config."""
        return TransferOptions(
            endpoint_url=self.endpoint_url,
            concurrency=self.transfer_concurrency,
            part_size=self.part_size,
            multipart_threshold=2 * self.part_size,
            request_timeout_s=self.request_timeout_s,
            max_attempts=self.remote_max_attempts,
            backoff_max_s=self.backoff_max_s,
            step_deadline_s=self.step_deadline_s,
            compression=self.remote_compression,
        )


_INT_FIELDS = {
    "every_steps", "keep_last", "keep_every", "io_threads",
    "remote_keep_last", "remote_keep_every", "transfer_concurrency", "part_size", "remote_max_attempts",
}
_FLOAT_FIELDS = {
    "every_seconds", "memory_budget", "mtbf_s", "free_space_margin", "collective_timeout_s", "save_agree_timeout_s",
    "request_timeout_s", "backoff_max_s", "step_deadline_s", "drain_timeout_s", "remote_commit_timeout_s",
}
_BOOL_FIELDS = {"capture_rng", "strict", "verify_on_load", "pin_memory", "trainable_only", "start_fresh",
                "overlap_copies"}
_INT_FIELDS |= {"max_pinned_bytes", "micro_batch_size", "grad_accum_steps", "keep_best", "full_every",
                "keep_last_light", "remote_every", "peer_replicas", "peer_bandwidth", "memory_every_steps",
                "memory_keep"}


def _parse_env(name: str, raw: str) -> Any:
    var = "SHARDCKPT_" + name.upper()
    text = raw.strip()
    if name == "preemption_signals" and text.lower() in ("", "none"):
        return ()
    if text.lower() in ("", "none") and name not in ("local_dir",):
        return None
    if name == "every_seconds" and text.lower() == "auto":
        return "auto"
    try:
        if name in _INT_FIELDS:
            return int(text)
        if name in _FLOAT_FIELDS:
            return float(text)
        if name in _BOOL_FIELDS:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if name == "preemption_signals":
            return tuple(_parse_signal(s) for s in text.split(",") if s.strip())
        if name == "run_config_ignore":
            return tuple(p.strip() for p in text.split(",") if p.strip())
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a valid value for {name}") from None
    return text


def _parse_signal(text: str) -> int:
    text = text.strip().upper()
    if text.isdigit():
        return int(text)
    if not text.startswith("SIG"):
        text = "SIG" + text
    value = getattr(signal, text, None)
    if not isinstance(value, signal.Signals):
        raise ValueError(text)  # named by the caller as the variable's invalid value
    return int(value)


def run_config_of(value: Any) -> Any:
    """``run_config`` as recorded: a dict as JSON allows, or a YAML/JSON file's parsed content."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"run_config={path!r} cannot be read ({exc}). Remedy: pass a dict or a readable "
                              f"YAML/JSON file") from exc
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError as exc:
                raise ConfigError("run_config is a YAML file: pip install pyyaml, or pass a dict") from exc
            value = yaml.safe_load(text)
        else:
            try:
                value = json.loads(text)
            except ValueError:
                return {"file": path, "text": text}
    return json.loads(json.dumps(value, default=str))


def record_shape(config: Any, micro_batch: int | None, accum_steps: int | None) -> None:
    """Make later saves record (micro-batch, accumulation) in the manifest metadata."""
    if micro_batch is None or config is None:
        return
    if hasattr(config, "micro_batch_size"):
        config.micro_batch_size = micro_batch
    if hasattr(config, "grad_accum_steps") and accum_steps is not None:
        config.grad_accum_steps = accum_steps
    metadata = getattr(config, "metadata", None)
    if isinstance(metadata, dict):
        metadata[MICRO_BATCH_KEY] = int(micro_batch)
        metadata[ACCUM_KEY] = int(accum_steps or 1)
