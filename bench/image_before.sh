#!/usr/bin/env bash
# The image size before issue 49, for docs/install.md's before/after: the Dockerfile as of eecd0d5 (one
# stage, setup as the app user with every extra, pip's cache kept), built from today's tree by
# scripts/image_check.sh with the two changes it needs to build at all on a machine without a registry:
# its base made a build argument (the debootstrap base) and pip's configuration passed in.
#   bench/image_before.sh      (as root; about 15 minutes; removes the image afterwards)
set -euo pipefail
cd "$(dirname "$0")/.."
before="$(mktemp /var/tmp/Dockerfile.before.XXXXXX)"
trap 'rm -f "$before"' EXIT
git show eecd0d5:Dockerfile \
  | sed -e 's/^FROM python:3.11.11-slim-bookworm$/ARG BASE_IMAGE=python:3.11.11-slim-bookworm\nFROM ${BASE_IMAGE}\nARG PIP_CONFIG_FILE/' \
        -e 's#export TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu#:#' > "$before"
grep -q 'ARG PIP_CONFIG_FILE' "$before" || { echo "image_before: the old Dockerfile did not take the edit" >&2; exit 1; }
DOCKERFILE="$before" BUILD_ONLY=1 bash scripts/image_check.sh
