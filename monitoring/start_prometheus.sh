#!/usr/bin/env bash
# Install Debian's prometheus package if missing, start Prometheus in the background and wait
# until it answers /-/ready. Prints the server's PID on stdout (stop it with `kill PID`).
#
#   bash monitoring/start_prometheus.sh [--config FILE] [--port N] [--data-dir DIR]
#                                      [--log FILE] [--timeout-s N]
#   bash monitoring/start_prometheus.sh --install-only     # for CI setup
#
# Installing needs root (apt-get); CI and the dev machines run as root.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
config="$here/prometheus.yml"
port=9090
data_dir=""
log=""
timeout_s=60
install_only=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --data-dir) data_dir="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    --timeout-s) timeout_s="$2"; shift 2 ;;
    --install-only) install_only=1; shift ;;
    *) echo "start_prometheus.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

install_prometheus() {
  if command -v prometheus >/dev/null 2>&1; then
    return
  fi
  if [[ $(id -u) -ne 0 ]]; then
    echo "start_prometheus.sh: prometheus is not installed and installing it needs root" >&2
    exit 1
  fi
  echo "start_prometheus.sh: installing Debian's prometheus package" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  # No recommends: the node exporter and friends are not needed to scrape Ray.
  apt-get install -y -qq --no-install-recommends prometheus >&2
}

install_prometheus
prometheus --version 2>&1 | head -1 >&2
if [[ $install_only -eq 1 ]]; then
  exit 0
fi

data_dir="${data_dir:-$(mktemp -d /tmp/vpd-prometheus.XXXXXX)}"
mkdir -p "$data_dir"
log="${log:-$data_dir/prometheus.log}"
ready_url="http://127.0.0.1:$port/-/ready"

# setsid: the server outlives this script and is not killed with the caller's terminal.
setsid prometheus \
  --config.file="$config" \
  --web.listen-address="127.0.0.1:$port" \
  --storage.tsdb.path="$data_dir" \
  >"$log" 2>&1 < /dev/null &
pid=$!

deadline=$((SECONDS + timeout_s))
until curl -fsS "$ready_url" >/dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "start_prometheus.sh: prometheus exited; its log ($log):" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  if (( SECONDS >= deadline )); then
    echo "start_prometheus.sh: not ready after ${timeout_s}s; its log ($log):" >&2
    tail -n 30 "$log" >&2
    kill "$pid" 2>/dev/null || true
    exit 1
  fi
  sleep 0.2
done
echo "start_prometheus.sh: ready at http://127.0.0.1:$port (pid $pid, log $log)" >&2
echo "$pid"
