"""The memory tier: snapshots in the node's memory (tmpfs), their file staging, peer copies to
another node, the sources a restore reads and the authenticated snapshot server."""
