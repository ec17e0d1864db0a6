#!/usr/bin/env bash
# Local multi-node harness: N Ray-ready "nodes" in network namespaces with shaped links (needs root).
#   cluster/local/netns.sh up --nodes 2 --bandwidth 1gbit [--delay 1ms] [--prefix rf] [--ray /tmp/rfr]
#   cluster/local/netns.sh status [--prefix rf]
#   cluster/local/netns.sh down [--prefix rf]
# A thin wrapper around cluster/local/netns.py (see its docstring); PYTHON picks the interpreter.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
case "${1:-}" in
  up|down|status) ;;
  *) echo "usage: $0 {up|down|status} [options]  (see: $0 up --help)" >&2; exit 2 ;;
esac
if [ "$(id -u)" -ne 0 ]; then
  echo "netns: error: the netns harness needs root (ip netns, veth, tc); run it with sudo" >&2
  exit 2
fi
exec "${PYTHON:-python3}" "$here/netns.py" "$@"
