"""What a step is on disk: the manifest and checksums, lineage (branches), retention, step directories."""
