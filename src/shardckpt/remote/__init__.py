"""The remote tier: the commit protocol and retention, the index of committed steps, node markers, early and
compressed uploads, need-only ranged reads."""
