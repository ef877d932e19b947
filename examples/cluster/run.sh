#!/bin/sh
# Three appserver instances on one PostgreSQL database behind a loopback balancer (docs/scale-out.md).
#   createdb -h 127.0.0.1 -U postgres appserver_cluster
#   sh examples/cluster/run.sh postgresql://postgres@127.0.0.1:5432/appserver_cluster
# Then point any client at http://127.0.0.1:8800 (OpenAI routes under /v1, WebSocket at /ws).
set -eu
URL=${1:?usage: run.sh postgresql://USER@HOST:PORT/DB}
ROOT=${APPSERVER_CLUSTER_DIR:-/tmp/appserver-cluster}
PY=${PYTHON:-.venv/bin/python}
pids=""
trap 'kill $pids 2>/dev/null' EXIT INT TERM
for i in 1 2 3; do
  APPSERVER_HOME="$ROOT/node$i" APPSERVER_STORE__URL="$URL" \
    "$PY" -m appserver serve --listen "127.0.0.1:880$i" &
  pids="$pids $!"
done
"$PY" examples/cluster/balancer.py 127.0.0.1:8800 127.0.0.1:8801 127.0.0.1:8802 127.0.0.1:8803 &
pids="$pids $!"
wait
