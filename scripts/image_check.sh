#!/usr/bin/env bash
# make image-check: build the CPU image from ./Dockerfile with podman and run the smoke pipeline in it.
#
#   scripts/image_check.sh            # as root on a Debian/Ubuntu machine (installs podman & co. with apt)
#   EXTRA=gpu scripts/image_check.sh  # the GPU image (make image-check EXTRA=gpu): built from PyPI alone (its CUDA
#                                     # torch and vLLM wheels carry the CUDA runtime; the host's driver comes in
#                                     # through the NVIDIA container toolkit), the CUDA builds verified inside
#                                     # (scripts/check_install.py --builds-only); what needs a GPU is said, not run
#   KEEP_IMAGE=1 scripts/image_check.sh   # keep the built image (posttrain-check:cpu) afterwards
#   DOCKERFILE=path BUILD_ONLY=1 scripts/image_check.sh   # only build (that Dockerfile), report its size
#                                     # (bench/image_size.sh: the image before issue 49 and now)
#
# Steps, each timed:
#   1. tools       podman, buildah, runc and debootstrap, installed with apt if missing; podman is run with
#                  a containers.conf of its own (runc, cgroupfs, file events, raised nofile/nproc ulimits), so
#                  the machine's configuration is not touched
#   2. base        the Dockerfile's BASE_IMAGE if it can be pulled; else a Debian bookworm base made with
#                  debootstrap (minbase + python3, venv, headers, certificates) and `podman import`ed, so no
#                  container registry is needed
#   3. pypi        the Dockerfile's defaults (EXTRA=gpu) resolve from PyPI alone (pip's dry run, nothing
#                  downloaded but metadata)
#   4. build       the project's Dockerfile (EXTRA=cpu) with this machine's pip configuration passed in
#                  (PIP_CONFIG_FILE and the files and directories it names, mounted read-only): its CA
#                  bundle, its mirrors, its wheel directories
#   5. sandbox     in the container, the code sandbox's tier must be the strongest (bubblewrap)
#   6. smoke       `pipeline run configs/smoke.yaml` in the container, to the end, exit 0
#   7. clean       removes the images, containers and files it made (the tools stay installed)
# It prints each step's time and the image's size. Not part of `make test`: a build takes ~15 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRA="${EXTRA:-cpu}"
case "$EXTRA" in cpu|gpu) ;; *) echo "image-check: EXTRA must be cpu or gpu, not '$EXTRA'" >&2; exit 2 ;; esac
TAG=localhost/posttrain-check:$EXTRA
BASE_TAG=localhost/posttrain-base:bookworm
DOCKERFILE="${DOCKERFILE:-Dockerfile}"
BASE_IMAGE="${BASE_IMAGE:-$(sed -n 's/^ARG BASE_IMAGE=//p' "$DOCKERFILE")}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11.11-slim-bookworm}"
WORK="$(mktemp -d /var/tmp/image-check.XXXXXX)"
MADE_BASE=0
T0=$(date +%s)
declare -a TIMES=()

say() { echo "image-check: $*"; }
die() { echo "image-check: FAILED: $*" >&2; exit 1; }
timed() {  # timed NAME COMMAND...: run it, record its seconds
  local name=$1 started; started=$(date +%s); shift
  say "[$name] $*" | cut -c1-200
  "$@" || die "step '$name' failed (exit $?)"
  TIMES+=("$name $(( $(date +%s) - started ))s")
}

cleanup() {
  local rc=$?
  if command -v podman >/dev/null; then
    podman rm -f --filter label=posttrain-image-check >/dev/null 2>&1 || true
    if [ "${KEEP_IMAGE:-0}" != 1 ]; then podman rmi -f "$TAG" >/dev/null 2>&1 || true; fi
    [ "$MADE_BASE" = 1 ] && { podman rmi -f "$BASE_TAG" >/dev/null 2>&1 || true; }
  fi
  rm -rf "$WORK"
  say "times: ${TIMES[*]:-none}; total $(( $(date +%s) - T0 ))s"
  [ $rc = 0 ] && say "passed" || say "exit $rc"
}
trap cleanup EXIT

[ "$(id -u)" = 0 ] || die "run as root (podman builds here need it, and the tools are installed with apt)"

# ---------------------------------------------------------------- 1. tools
install_tools() {
  local missing=() tool
  for tool in podman buildah runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ ${#missing[@]} = 0 ] && return 0
  command -v apt-get >/dev/null || { echo "missing ${missing[*]} and no apt-get: install them yourself" >&2; return 1; }
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    podman buildah runc debootstrap fuse-overlayfs uidmap >/dev/null
}
timed tools install_tools
# crun (podman's default) refuses some hosts' cgroup layouts, podman's systemd defaults need a systemd host,
# and its default ulimits can exceed what the machine allows (runc: "error setting rlimit ... operation not
# permitted"): a configuration of our own, through CONTAINERS_CONF, leaves the machine's untouched.
NOFILE=$(ulimit -Hn); [ "$NOFILE" = unlimited ] || [ "$NOFILE" -gt 65536 ] && NOFILE=65536
NPROC=$(ulimit -Hu); PID_MAX=$(cat /proc/sys/kernel/pid_max)
{ [ "$NPROC" = unlimited ] || [ "$NPROC" -gt "$PID_MAX" ]; } && NPROC=$PID_MAX
cat > "$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$NOFILE:$NOFILE", "nproc=$NPROC:$NPROC"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"

# ---------------------------------------------------------------- 2. base
debian_base() {
  local mirror
  mirror="$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
  mirror="${mirror:-http://deb.debian.org/debian}"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates,passwd \
    bookworm "$WORK/rootfs" "$mirror" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; return 1; }
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | podman import --change 'CMD ["python3"]' - "$BASE_TAG" >/dev/null
  rm -rf "$WORK/rootfs"
  MADE_BASE=1
}
if timeout 120 podman pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
  say "base: pulled $BASE_IMAGE"
else
  say "base: $BASE_IMAGE cannot be pulled here; building $BASE_TAG with debootstrap"
  timed base debian_base
  BASE_IMAGE="$BASE_TAG"
fi

# ---------------------------------------------------------------- 3. build
# pip's configuration as pip itself resolves it (files and PIP_* variables): written into one file, and
# every path it names mounted read-only at the same place in the build.
PY="$(command -v python3)"
MOUNTS=()
mkdir -p "$WORK/pip"
chmod 755 "$WORK" "$WORK/pip"  # read by the build's own user too (a Dockerfile may run pip as non-root)
"$PY" -m pip config list 2>/dev/null | "$PY" -c '
import re, sys
sections = {}
for line in sys.stdin:  # section.key=value; ":env:" is a PIP_* variable, which wins over the files
    m = re.match(r"^(:env:|[\w-]+)\.([\w-]+)=(.*)$", line.strip())
    if m:
        section, key, value = m.group(1), m.group(2), m.group(3).strip("\x27\"")
        target = sections.setdefault("global" if section == ":env:" else section, {})
        if section == ":env:" or key not in target or section != "global":
            target[key] = value
        if section == ":env:":
            sections.setdefault("_env", set()).add(key)
sections.pop("_env", None)
for name, values in sections.items():
    print(f"[{name}]")
    for k, v in values.items():
        print(f"{k} = {v}")
' > "$WORK/pip/pip.conf"
chmod 644 "$WORK/pip/pip.conf"
# a local index (file://.../simple) links its files relatively (../../files/...): its parent is mounted
for path in $(sed -n 's/^[a-z-]* = //p' "$WORK/pip/pip.conf" | tr ' ' '\n' | sed -e 's#^file://##' -e 's#/simple/*$##'); do
  case "$path" in /*) [ -e "$path" ] && MOUNTS+=(-v "$path:$path:ro") ;; esac
done
say "pip configuration passed in: $(grep -c ' = ' "$WORK/pip/pip.conf") setting(s), ${#MOUNTS[@]} mount argument(s)"

# The Dockerfile's defaults (EXTRA=gpu, no TORCH_INDEX_URL) on a machine that reaches PyPI and nothing else:
# pip resolves setup.sh's torch pin and the image's extras from https://pypi.org/simple alone (no mirror, no
# wheel directory, no constraints; only the CA bundle, which a TLS-intercepting proxy needs), in dry-run mode:
# PyPI serves each wheel's metadata by itself, so the GPU wheels (several GB) are not downloaded.
pypi_only() {
  local cert torch unset=()
  cert="$(sed -n 's/^cert = //p' "$WORK/pip/pip.conf" | head -1)"
  torch="$(grep -o '"torch==[0-9.]*"' scripts/setup.sh | head -1 | tr -d '"')"
  [ -n "$torch" ] || { echo "no torch pin found in scripts/setup.sh" >&2; return 1; }
  for var in $(env | sed -n 's/^\(PIP_[A-Z_]*\)=.*/\1/p'); do unset+=(-u "$var"); done
  "$PY" -m venv "$WORK/pypi-venv"
  env "${unset[@]}" PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$WORK/pypi-venv/bin/pip" install --dry-run --ignore-installed --quiet --report "$WORK/pypi.json" \
    --index-url https://pypi.org/simple ${cert:+--cert "$cert"} "$torch" ".[gpu,real]" \
    > "$WORK/pypi.log" 2>&1 || { tail -20 "$WORK/pypi.log"; return 1; }
  "$PY" -c '
import json, sys
report = json.load(open(sys.argv[1]))
got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
hosts = {i["download_info"]["url"].split("/")[2] for i in report["install"] if i["download_info"]["url"].startswith("http")}
torch, vllm = got.get("torch"), got.get("vllm")
print(f"image-check: the defaults resolve from PyPI alone: {len(got)} packages (torch {torch}, vllm {vllm})",
      f"from {sorted(hosts)}")
assert torch and vllm, "torch or vllm is missing from the resolution"
' "$WORK/pypi.json"
}
[ "${BUILD_ONLY:-0}" = 1 ] || timed pypi pypi_only
if [ "$EXTRA" = gpu ]; then
  # PyPI alone, as the Dockerfile's defaults: this machine's wheel directories hold CPU builds of torch, which
  # would satisfy the pin; only the CA bundle of its pip configuration is passed in.
  cert="$(sed -n 's/^cert = //p' "$WORK/pip/pip.conf" | head -1)"
  { echo "[global]"; echo "index-url = https://pypi.org/simple"; [ -n "$cert" ] && echo "cert = $cert"; } \
    > "$WORK/pip/pip.conf"
  MOUNTS=(); [ -n "$cert" ] && MOUNTS=(-v "$cert:$cert:ro")
fi
timed build podman build --network host --layers=false -f "$DOCKERFILE" -t "$TAG" \
  --label posttrain-image-check=1 \
  --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg EXTRA="$EXTRA" \
  --build-arg PIP_CONFIG_FILE=/run/pip-host/pip.conf -v "$WORK/pip:/run/pip-host:ro" "${MOUNTS[@]}" .
SIZE=$(podman image inspect --format '{{.Size}}' "$TAG")
say "image size: $(( SIZE / 1024 / 1024 )) MiB ($TAG, from $DOCKERFILE)"
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0

# ---------------------------------------------------------------- 4.-5. in the container
# The flags the sandbox's strongest tier needs (docs/security.md): user namespaces (seccomp), mount (AppArmor
# hosts), an unmasked /proc.
# --shm-size: vLLM's engine core and Ray's object store use /dev/shm, 64 MB by default in a container.
RUN=(podman run --rm --network host --label posttrain-image-check=1 --security-opt seccomp=unconfined
     --security-opt apparmor=unconfined --security-opt unmask=ALL --shm-size=2g)
sandbox_tier() {
  "${RUN[@]}" --entrypoint python "$TAG" -c "
from stages.ppo import sandbox
d = sandbox.describe()
print('sandbox:', d)
assert str(d.get('sandbox_strong')).lower() == 'true', 'the sandbox is not at its strongest tier in the image'
"
}
timed sandbox sandbox_tier
if [ "$EXTRA" = gpu ]; then
  # The build ran `check_install.py gpu --builds-only` (setup.sh): CUDA torch and the CUDA vLLM alone. Run again
  # in the final image, where a broken copy of the venv would show.
  timed builds "${RUN[@]}" --entrypoint python "$TAG" scripts/check_install.py gpu --builds-only
  say "not checked here (no GPU on this machine): that torch sees a GPU in the container, DeepSpeed and vLLM on"
  say "CUDA, and the smoke run; on a GPU machine: podman run --device nvidia.com/gpu=all (or docker run --gpus all)"
  say "$TAG, then inside it: bash scripts/gpu_check.sh (docs/install.md)"
  exit 0
fi
# The run directory is the host's ($WORK/run), so a failing stage's log can be shown before it is removed.
mkdir -p "$WORK/run" && chmod 777 "$WORK/run"
smoke() {
  "${RUN[@]}" -v "$WORK/run:/tmp/run" "$TAG" run configs/smoke.yaml run_dir=/tmp/run && return 0
  local rc=$? log
  for log in "$WORK"/run/logs/*.log; do
    [ -f "$log" ] && grep -qE "Error|Traceback" "$log" && { echo "---- the last lines of $log"; tail -60 "$log"; }
  done
  return $rc
}
timed smoke smoke
say "image size: $(( SIZE / 1024 / 1024 )) MiB"
