#!/usr/bin/env bash
# Nodes as network namespaces on this machine (root): a bridge, one namespace per node, no route out.
#   scripts/netns_nodes.sh up --nodes 3 --prefix demo     # prints: name namespace address
#   ip netns exec demo0 .venv/bin/python -m elastor_ds.cli run --local-addr 10.77.0.1 ...
#   scripts/netns_nodes.sh cut --prefix demo --node 1 [--how link-down|drop]
#   scripts/netns_nodes.sh heal --prefix demo --node 1
#   scripts/netns_nodes.sh slow --prefix demo --node 1 --rate-kbit 2000
#   scripts/netns_nodes.sh kill --prefix demo --node 1     # SIGKILL every process of the node
#   scripts/netns_nodes.sh down --prefix demo              # kill everything in the bed, delete it
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" -m elastor_ds.testing.netns "$@"
