"""What each node wrote of a step: its marker, the identity check of the step's objects, the failure report.

A node's marker, ``<remote>/step_<N>/_nodes/ranks-<a>-<b>-<n>.json``, is a
JSON object written after the node's uploads of the step::

    format        "shardckpt-node/1"
    node          the node's name
    ranks         the ranks it uploaded files of
    files         {name: checksum}: the manifest's checksum of each file it uploaded
    files_digest  the digest of the manifest's file table (which save of the step)
    tags          {name: tag}: what the store answered to each PUT (S3's ETag);
                  absent, or without a name, where the store gave none

Fields added later are optional and readers ignore those they do not know,
so an older marker reads as one without them (``tags`` missing: that node's
objects are checked as before, one HEAD each).

**Identity without reading every object.** A step is committed only with
objects of *its* save (one save id, one file table). The committer learns
what each node stored from the ``tags`` of its marker and compares them
with one listing of the step's objects (S3 lists each object's ETag; the
listing's pages are read concurrently, about ``N / 1000`` requests instead
of ``N`` HEADs), once before it writes the manifest and once after. An
ETag names the bytes one PUT stored: another save's upload of the same key
(same step number, other content) lists another ETag. Who may write a key
of a step: that step number's saves, each through one node's uploader, one
pass at a time; so a foreign object comes from another save of the number
(a rollback or a restart saved it again, or a second run writes to the
prefix). The interleavings, each node's PUT of key *k* landing at time
*w* and the committer's manifest PUT at *m*, its checks at *c1 < m < c2*:

* *w < c2*: the committer's listing at *c2* shows the other ETag: the commit
  is withdrawn (before *c1*: it is not made);
* *w > c2*: the writing node, after its uploads of a pass and before its
  marker (and after an early upload), looks for a manifest (one HEAD; S3
  reads after writes are consistent); at that moment *m < w* so it finds
  the other save's commit, and when that manifest names one of its keys
  with another checksum it withdraws that commit (step record and manifest
  away, the index entry dropped).

Either way the other save's commit does not stay: what is left is the time
between the foreign PUT landing and its writer's HEAD (one request), in
which a restore reading that step meets an object that fails its checksum
and is refused (never loaded). Before the writer-side check that window
stayed open for good; HEADs of every object closed no more of it.
A node re-uploading after a restart uploads its own bytes again (same save:
not foreign; its new marker names the new ETags); an uploader SIGKILLed
mid-upload leaves no marker, so its node's files are not covered and the
step waits for it. Conditional writes (``If-None-Match``/``If-Match``) would
not close that window either (the commit changes no object the writer's
condition could depend on) and stores differ in whether they honour them,
so none is relied on. A store whose listing carries no tags (``file://`` and
other fsspec stores; an S3-compatible store that lists no ETag) is checked
as before, one lookup of the recorded checksum per object.
The listing must be as fresh as a read (AWS S3, MinIO, moto and rclone are):
a listing that lags shows a new object as missing, and the step waits.

**A failed step's report.** Past ``remote_commit_timeout_s`` the committer
(or, if its marker is missing, the node holding the highest rank) names the
ranks no marker covers, and the nodes that held them in the newest committed
step, in one object, ``step_<N>/_failed.json``; every other node reads that
object rather than every marker: ``O(N)`` requests in all, not ``O(N^2)``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from shardckpt.format import layout
from shardckpt.remote import compressed
from shardckpt.remote.index import step_key
from shardckpt.stores import Deadline, Store

log = logging.getLogger("shardckpt")

NODES_DIR = "_nodes"
MARKER_FORMAT = "shardckpt-node/1"
REPORT_NAME = "_failed.json"
REPORT_FORMAT = "shardckpt-failed/1"


def marker_name(ranks: list[int]) -> str:
    return f"ranks-{ranks[0]}-{ranks[-1]}-{len(ranks)}.json"


def marker_ranks(name: str) -> set[int] | None:
    """The ranks a marker's name stands for when they are contiguous (``n == b - a + 1``), else ``None``."""
    parts = name[: -len(".json")].split("-") if name.startswith("ranks-") and name.endswith(".json") else []
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    first, last, count = (int(p) for p in parts[1:])
    return set(range(first, last + 1)) if last - first + 1 == count else None


def parse(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return body if isinstance(body, dict) and body.get("format") == MARKER_FORMAT else {}


class MarkerCache:
    """Markers a node has read, by step, name and the tag of the marker object: each is read once.

    The committer polls the markers of a step until they cover every file;
    a marker it has read and whose listed tag has not changed is not read
    again, so a commit reads each node's marker once, not once per poll.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str], tuple[str, dict[str, Any]]] = {}

    def get(self, step: int, name: str, tag: str) -> dict[str, Any] | None:
        got = self._seen.get((step, name))
        return got[1] if got is not None and tag and got[0] == tag else None

    def put(self, step: int, name: str, tag: str, body: dict[str, Any]) -> None:
        if tag:
            self._seen[(step, name)] = (tag, body)

    def forget(self, step: int) -> None:
        for key in [k for k in self._seen if k[0] == step]:
            del self._seen[key]


def read_markers(
    store: Store, step: int, deadline: Deadline, cache: MarkerCache | None = None, only: set[int] | None = None
) -> list[dict[str, Any]]:
    """The markers of ``step`` (one listing; a GET of each marker not in ``cache``).

    ``only``: just the markers whose name may cover one of these ranks.
    """
    prefix = step_key(step, NODES_DIR)
    listed = store.list_tags(prefix, deadline)
    names = sorted(n for n in (listed if listed is not None else store.list_sizes(prefix, deadline))
                   if n.endswith(".json"))
    if only is not None:
        names = [n for n in names if (marker_ranks(n) or only) & only]
    tags = {n: (listed or {}).get(n, (0, ""))[1] for n in names}
    known = {n: cache.get(step, n, tags[n]) for n in names} if cache is not None else {}
    todo = [n for n in names if known.get(n) is None]
    bodies = store.run_all(
        [lambda n=n: store.get_bytes(step_key(step, f"{NODES_DIR}/{n}"), deadline) for n in todo], files=True
    ) if todo else []
    for name, data in zip(todo, bodies):
        known[name] = parse(data or b"")
        if cache is not None and known[name]:
            cache.put(step, name, tags[name], known[name])
    return [known[n] for n in names if known.get(n)]


def coverage(
    markers: list[dict[str, Any]], manifest: layout.Manifest, digest: str
) -> tuple[set[str], dict[str, str], list[str]]:
    """The files of ``manifest`` that markers of this save name with its checksum, the tags they
    give for them, and the nodes whose markers of this save are there."""
    covered: set[str] = set()
    tags: dict[str, str] = {}
    present: list[str] = []
    for marker in markers:
        if marker.get("files_digest") != digest:
            continue  # a stale marker of another save of this step number
        present.append(str(marker.get("node")))
        given = marker.get("tags") if isinstance(marker.get("tags"), dict) else {}
        for name, sha in (marker.get("files") or {}).items():
            entry = manifest.files.get(name)
            if entry is not None and entry.checksum == sha:
                covered.add(name)
                if isinstance(given.get(name), str) and given[name]:
                    tags[name] = given[name]
    return covered, tags, present


def foreign_objects(
    store: Store, step: int, manifest: layout.Manifest, tags: dict[str, str], deadline: Deadline
) -> tuple[list[str], list[str]]:
    """The step's objects that are missing (or not of their size), and those that are not the
    bytes this save's nodes stored: one message each.

    ``manifest`` is the remote one: a file uploaded compressed is judged by its
    stored object (:func:`compressed.expected`: ``<name>.szc``, its stored size).
    Objects with a tag in ``tags``: one listing of the step (its pages read
    concurrently). The others: their recorded checksum, one lookup each.
    """
    names = sorted(manifest.files)
    objects = {name: compressed.expected(manifest, name) for name in names}
    listed = store.list_tags(layout.step_dirname(step), deadline, [objects[n][0] for n in names]) if tags else None

    def judge(name: str, got: tuple[int, str] | None, want: str) -> tuple[str, str] | None:
        obj, size, _checksum = objects[name]
        if got is None or got[0] != size:
            return "missing", f"object {store.where(step_key(step, obj))} is missing or has the wrong size"
        if got[1] != want:
            return "foreign", f"object {store.where(step_key(step, obj))} is of another save"
        return None

    found: list[tuple[str, str] | None] = []
    lookups: list[str] = []
    for name in names:
        tag = tags.get(name)
        if tag and listed is not None:
            found.append(judge(name, listed.get(objects[name][0]), tag))
        else:
            lookups.append(name)

    def check(name: str) -> tuple[str, str] | None:
        obj, _size, checksum = objects[name]
        return judge(name, store.recorded_checksum(step_key(step, obj), checksum, deadline), checksum)

    found += store.run_all([lambda n=n: check(n) for n in lookups], files=True)
    return ([t for k, t in filter(None, found) if k == "missing"],
            [t for k, t in filter(None, found) if k == "foreign"])


def missing_ranks(
    store: Store, step: int, manifest: layout.Manifest, deadline: Deadline, *, earlier: int | None = None,
    cache: MarkerCache | None = None,
) -> dict[str, Any]:
    """Why ``step`` is not committed: the ranks whose files no node marker of this save covers.

    ``nodes`` names the nodes that held those ranks in ``earlier`` (a committed
    step, e.g. the newest one) where their markers say so (only the markers
    whose names may cover those ranks are read); ``present`` names the nodes
    whose markers of this save are there.
    """
    covered, _tags, present = coverage(read_markers(store, step, deadline, cache), manifest,
                                       layout.files_digest(manifest))
    ranks = sorted({manifest.files[n].rank for n in set(manifest.files) - covered})  # .metadata: the committer's
    nodes: set[str] = set()
    if ranks and earlier is not None and earlier != step:
        for marker in read_markers(store, earlier, deadline, only=set(ranks)):
            if set(marker.get("ranks") or []) & set(ranks):
                nodes.add(str(marker.get("node")))
    return {"ranks": ranks, "nodes": sorted(nodes), "present": sorted(present)}


def reporters(manifest: layout.Manifest) -> tuple[str, str]:
    """The files whose holders write a failed step's report: rank 0's first shard file (the
    committer's) and the highest rank's first shard file (when the committer is the one missing)."""
    shards = [n for n in manifest.files if n != layout.METADATA_NAME] or [layout.METADATA_NAME]
    first = min(shards, key=lambda n: (manifest.files[n].rank, n))
    last = min(shards, key=lambda n: (-manifest.files[n].rank, n))
    return first, last


def write_report(store: Store, step: int, manifest: layout.Manifest, failed: dict[str, Any], node: str,
                 deadline: Deadline) -> None:
    body = {"format": REPORT_FORMAT, "step": step, "files_digest": layout.files_digest(manifest), "by": node,
            "time": time.time(), **{k: failed.get(k, []) for k in ("ranks", "nodes", "present")}}
    store.put_bytes(step_key(step, REPORT_NAME), json.dumps(body, sort_keys=True).encode(), deadline)


def read_report(store: Store, step: int, manifest: layout.Manifest, deadline: Deadline) -> dict[str, Any] | None:
    """The failed step's report of this save (``ranks``, ``nodes``, ``present``, ``by``), else ``None``."""
    data = store.get_bytes(step_key(step, REPORT_NAME), deadline)
    if data is None:
        return None
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("format") != REPORT_FORMAT:
        return None
    if body.get("files_digest") != layout.files_digest(manifest):
        return None  # a report of another save of this step number
    return {k: body.get(k) for k in ("ranks", "nodes", "present", "by")}
