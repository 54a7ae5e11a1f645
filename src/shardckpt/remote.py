"""Remote tier: URL checks (the store and uploader build on this)."""

from __future__ import annotations

from .errors import ConfigError


def check_remote_url(url: str) -> None:
    if "://" not in url:
        raise ConfigError(f"remote must be a URL such as s3://bucket/prefix or file:///path, got {url!r}")
    raise ConfigError(
        f"remote={url!r}: the remote tier is not available in this release; use local_dir only"
    )
