"""A manifest's text sealed reusing the last manifest's field texts (``manifest_schema.seal_reusing``, what a save
kept in memory writes at every step) is byte for byte the text sealed anew, whatever changed in between."""

from __future__ import annotations

from shardckpt.format import layout, manifest_schema


def test_a_manifest_sealed_reusing_the_last_ones_fields_is_the_same_text():
    cache: dict = {}
    body = {"step": 1, "files": {}, "created": 1.5, "keys": {"model": "module", "meta": "value"},
            "metadata": {"note": "a\nb", "list": [1, 2.0, True, None]}, "lineage": {"branch": "", "forks": []},
            "run": {"argv": ["train.py"], "config": None}, "upload": True, "copies": [[0]], "metrics": {}}
    changes = [
        lambda b: b.update(step=2, created=2.25),
        lambda b: b["metadata"]["list"].__setitem__(1, 2),  # 2.0 -> 2: the same by ==, not as JSON
        lambda b: b["metadata"]["list"].__setitem__(2, 1),  # True -> 1
        lambda b: b.update(metrics={"loss": 0.0}),
        lambda b: b.update(metrics={"loss": -0.0}),
        lambda b: b["lineage"]["forks"].append([3, "abc"]),  # the same dict object, changed in place
        lambda b: b.update(copies=[[0], [1]]),
        lambda b: b.pop("upload"),
        lambda b: b.update(upload=False, extra={"nested": {"deeper": [{}]}}),
    ]
    for change in [lambda b: None] + changes:
        change(body)
        assert manifest_schema.seal_reusing(body, cache) == manifest_schema.seal(body)
    manifest = layout.Manifest(step=7, world_size=2, files={"a.distcp": layout.FileEntry(3, "sha256:" + "0" * 64, 1)},
                               metadata={"a": (1, 2)}, save_id="x-7")
    texts: dict = {}
    for step in (7, 8):
        manifest.step = step
        assert manifest.to_json(texts) == manifest.to_json()
        again = layout.Manifest.from_json(manifest.to_json(texts), f"/tmp/step_{step:010d}/shardckpt.json")
        assert again.to_json() == manifest.to_json()
