#!/usr/bin/env bash
# The container image's size before issue 49 and now, built in one invocation on this machine:
#   before: the Dockerfile as of eecd0d5 (one stage, setup as the app user with every extra, pip's cache kept),
#           with the edits it needs to build at all here: its base made a build argument (scripts/image_check.sh's
#           debootstrap base), pip's configuration passed in, and /app owned by the app user (WORKDIR makes it
#           root's, and its setup, run as app, could not create /app/.venv: the first attempt failed there)
#   after:  today's Dockerfile
# Both from today's tree, both EXTRA=cpu, both by scripts/image_check.sh with BUILD_ONLY=1 (removes the images).
#   bench/image_size.sh      (as root; about 25 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
before="$(mktemp /var/tmp/Dockerfile.before.XXXXXX)"
logs="$(mktemp -d /var/tmp/image-size.XXXXXX)"
trap 'rm -rf "$before" "$logs"' EXIT
git show eecd0d5:Dockerfile \
  | sed -e 's/^FROM python:3.11.11-slim-bookworm$/ARG BASE_IMAGE=python:3.11.11-slim-bookworm\nFROM ${BASE_IMAGE}\nARG PIP_CONFIG_FILE/' \
        -e 's#export TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu#:#' \
        -e 's#^WORKDIR /app$#WORKDIR /app\nRUN chown app:app /app#' > "$before"
grep -q 'ARG PIP_CONFIG_FILE' "$before" && grep -q 'RUN chown app:app /app' "$before" || { echo "image_size: the old Dockerfile did not take the edit" >&2; exit 1; }

build() {  # build NAME DOCKERFILE: sets MIB and SECONDS_TAKEN from scripts/image_check.sh's report
  DOCKERFILE="$2" BUILD_ONLY=1 bash scripts/image_check.sh > "$logs/$1.txt" 2>&1 \
    || { tail -30 "$logs/$1.txt"; echo "image_size: the $1 build failed" >&2; exit 1; }
  MIB="$(sed -n 's/^image-check: image size: \([0-9]*\) MiB.*/\1/p' "$logs/$1.txt" | head -1)"
  SECONDS_TAKEN="$(grep -o 'build [0-9]*s' "$logs/$1.txt" | tail -1 | grep -o '[0-9]*')"
}
build before "$before"; before_mib=$MIB
echo "before (eecd0d5's Dockerfile): $MIB MiB, built in $SECONDS_TAKEN s"
build after Dockerfile; after_mib=$MIB
echo "after (Dockerfile at $(git rev-parse --short HEAD)): $MIB MiB, built in $SECONDS_TAKEN s"
python3 -c "import sys; b, a = map(int, sys.argv[1:]); print(f'after/before: {a / b:.2f} ({b - a} MiB smaller)')" \
  "$before_mib" "$after_mib"
