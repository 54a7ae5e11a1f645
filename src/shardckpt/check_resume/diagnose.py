"""The cause of a resume that differs, from what the records of ``shardckpt check-resume`` hold (torch-free).

:func:`compare.meaning <shardckpt.check_resume.compare.meaning>` says what the
keys that differ usually point at. Some causes the records prove, and they are
named first (:func:`causes`):

* the loop's numbering: the resumed run's first ``save()`` call is at the step
  it restored (numbered again) or after a gap (a step skipped);
* gradients pending at the ``save()`` the resume restored (recorded by
  ``saving/pending_grads.py``): a checkpoint holds no ``.grad``;
* the learning rate set after ``load()``: it differs while the LR scheduler was
  restored and stepped as often (its ``last_epoch`` equal in both runs);
* a plain value that differs, shown with its two values (``compare.KeyDiff``).

:func:`warnings` quotes shardckpt's own WARNINGs from a run's log (a value
differing across ranks, an integration's notes): they often name the fault.
"""

from __future__ import annotations

from typing import Any

from shardckpt.check_resume import compare

MAX_QUOTED = 6
"""WARNING lines quoted per run at most."""


def _first_save(records: list[dict[str, Any]]) -> int | None:
    """The step of the run's first ``save()`` call (the lowest over its lanes' first calls)."""
    firsts = []
    for steps in compare.series(records).values():
        firsts.append(min(steps))
    return min(firsts) if firsts else None


def numbering(resumed: list[dict[str, Any]], ref: list[dict[str, Any]], start: int) -> str | None:
    """The resumed run numbers its steps differently: the restored step again, or a gap after it (its first
    ``save()`` call after a step at which the reference called it; a script may call save() every k steps)."""
    first = _first_save(resumed)
    expected = min((s for steps in compare.series(ref).values() for s in steps if s > start), default=None)
    if first is None or first == expected or (first > start and expected is None):
        return None
    if first <= start:
        return (f"the resumed run's first save() call is at step {first}, the step it restored: the loop numbers the "
                f"restored step again (one step of data and updates shifted from there on). load() returns the "
                f"step the checkpoint holds, already done: continue at the step after it (step = ckpt.load(state) "
                f"or 0, then step += 1 before the step's work, as the first run counts).")
    if first < expected:
        return None  # saves the reference does not make: the "missing save()" meaning says so
    return (f"the resumed run's first save() call is at step {first}, after restoring step {start}, where the "
            f"reference called save() at step {expected}: the loop skips step{'s' if first - start > 2 else ''} "
            f"{start + 1}{f'..{first - 1}' if first - start > 2 else ''} (it counts from load()'s return + 1 "
            f"twice, or from a counter that is not the saved step).")


def pending(killed: list[dict[str, Any]], start: int) -> str | None:
    """Gradients were pending at the killed run's ``save()`` of the step the resume restored."""
    keys = sorted({key for record in killed if record.get("event") == "save" and int(record["step"]) == start
                   for key, entry in (record.get("keys") or {}).items() if entry.get("pending_grads")})
    if not keys:
        return None
    return (f"gradients were pending at the save() of step {start}, the step the resume restored (optimizer "
            f"{', '.join(map(repr, keys))}: a backward() after its last step(), the middle of gradient "
            f"accumulation). A "
            f"checkpoint holds no .grad: the resumed run lost them. Call save() after optimizer.step(), at the end "
            f"of an accumulation window.")


def _at(records: list[dict[str, Any]], step: int) -> dict[compare.Lane, dict[str, Any]]:
    return {lane: steps[step] for lane, steps in compare.series(records).items() if step in steps}


def lr_after_load(diff: compare.Difference, mine: list[dict[str, Any]], ref: list[dict[str, Any]]) -> str | None:
    """The learning rate differs while a restored LR scheduler was stepped as often: set after ``load()``."""
    if "lr" not in diff.roles():
        return None
    a, b = _at(mine, diff.step), _at(ref, diff.step)
    for lane in diff.lanes:
        ka = (a.get(lane.lane) or {}).get("keys") or {}
        kb = (b.get(lane.lane) or {}).get("keys") or {}
        for key, entry in ka.items():
            if entry.get("role") != "scheduler" or key not in kb:
                continue
            ea, eb = (entry.get("values") or {}).get("last_epoch"), (kb[key].get("values") or {}).get("last_epoch")
            if ea is not None and ea == eb:
                return (f"the learning rate differs though the LR scheduler {key!r} was restored and stepped as "
                        f"often (last_epoch {ea} in both runs): the script sets the learning rate after load() (an "
                        f"assignment to param_groups' 'lr', an optimizer or scheduler made again after load(), a "
                        f"warm-up applied again). Set it before load(), or let the scheduler alone set it.")
    return None


def causes(diff: compare.Difference, start: int, mine: list[dict[str, Any]], ref: list[dict[str, Any]],
           killed: list[dict[str, Any]], twice: bool) -> list[str]:
    """What the difference means, the causes the records prove first, then what the keys usually mean."""
    found = [c for c in (numbering(mine, ref, start), pending(killed, start), lr_after_load(diff, mine, ref)) if c]
    return found or [compare.meaning(diff, twice)]


def warnings(log_path: str) -> list[str]:
    """shardckpt's WARNING lines in a run's log, each once (at most :data:`MAX_QUOTED`)."""
    found: list[str] = []
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        text = line.strip()
        at = text.find("shardckpt:")
        if at < 0 or text.startswith("shardckpt check-resume:") or "INFO" in text[:at]:
            continue
        if at > 0 and "WARN" not in text[:at]:
            continue  # "shardckpt:" inside another line (a traceback, a path): not a message of ours
        text = text[at:]
        if text not in found:
            found.append(text[:400])
        if len(found) >= MAX_QUOTED:
            break
    return found
