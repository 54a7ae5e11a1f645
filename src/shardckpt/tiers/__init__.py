"""Where a step's bytes live: the local disk, the remote store, other nodes (the peer tier), and the readers of DCP's files."""
