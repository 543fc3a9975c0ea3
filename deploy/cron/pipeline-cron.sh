#!/usr/bin/env bash
# Run the pipeline from cron (or any scheduler): see deploy/README.md.
#
#   # m h dom mon dow   command                                       (crontab -e)
#   0 3 * * *   /srv/posttrain/deploy/cron/pipeline-cron.sh /srv/posttrain/configs/full.yaml
#
# Cron gives a minimal environment (PATH=/usr/bin:/bin, cwd $HOME), so this script finds the
# project from its own location and uses the project's .venv. A run with nothing changed does no
# work (every stage is a cache hit, Ray is not even started); new raw data reruns the data stage
# and what depends on it. Each run leaves <log dir>/<time>.log (progress) and <time>.json (the
# `run --json` summary); `latest.log` / `latest.json` point at the newest.
#
# Arguments: CONFIG [key.path=value ...] [--only/--from/--to/--force ...], passed to `run`.
# Environment (optional): PIPELINE_HOME (default: this script's project), PIPELINE_LOG_DIR (default
# $PIPELINE_HOME/runs/cron-logs), PIPELINE_PYTHON (default $PIPELINE_HOME/.venv/bin/python), and
# anything the run reads (RAY_ADDRESS, MLFLOW_TRACKING_URI).
# Exit code: the pipeline's (0 ok, 1 a stage failed, 2 config error, 3 another run is still going).
set -uo pipefail

if [ "$#" -lt 1 ]; then
    echo "usage: $0 CONFIG [key.path=value ...] [--only STAGE ...]" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
home="${PIPELINE_HOME:-$(cd "$here/../.." && pwd)}"
python="${PIPELINE_PYTHON:-$home/.venv/bin/python}"
logs="${PIPELINE_LOG_DIR:-$home/runs/cron-logs}"
if [ ! -x "$python" ]; then
    echo "pipeline-cron: no Python at $python; run 'make setup' in $home or set PIPELINE_PYTHON" >&2
    exit 2
fi
mkdir -p "$logs" || exit 2
config="$1"; shift
case "$config" in /*) ;; *) config="$PWD/$config" ;; esac  # relative to where the scheduler started us
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
cd "$home" || exit 2
"$python" -m pipeline run "$config" --json "$@" >"$logs/$stamp.json" 2>"$logs/$stamp.log"
code=$?
ln -sfn "$stamp.log" "$logs/latest.log"
ln -sfn "$stamp.json" "$logs/latest.json"
case "$code" in
    0) outcome="succeeded" ;; 1) outcome="a stage failed" ;; 2) outcome="configuration error" ;;
    3) outcome="skipped: another run still holds the run directory" ;; *) outcome="ended with code $code" ;;
esac
echo "$(date -u +%FT%TZ) pipeline $config: $outcome (exit $code; log $logs/$stamp.log)" >>"$logs/history.log"
exit "$code"
