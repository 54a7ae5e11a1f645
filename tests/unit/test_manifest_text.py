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


def test_a_field_that_is_a_str_subclass_is_reused_as_its_text():
    """``torch.__version__`` is a ``TorchVersion``: the same text as the ``str`` the cache keeps, so it is not
    encoded again at every save (with ``indent``, Python's JSON encoder is its slow pure-Python one)."""
    import torch

    body = {"step": 1, "torch_version": torch.__version__, "run": {"torch": torch.__version__, "argv": ["x"]}}
    cache: dict = {}
    assert manifest_schema.seal_reusing(body, cache) == manifest_schema.seal(body)
    kept = {k: cache[k] for k in ("torch_version", "run")}
    body["step"] = 2
    assert manifest_schema.seal_reusing(body, cache) == manifest_schema.seal(body)
    assert all(cache[k] is v for k, v in kept.items())  # reused, not made again
    assert not manifest_schema.same_json(torch.__version__, "2.0") and manifest_schema.same_json("1", "1")
