# Sourced by .ci/run (as root, on a fresh Debian 12 machine): sets up the container engines that
# the `docker`-marked sandbox tests use, so that they run for real instead of skipping.
#
#   1. apt: docker.io (dockerd + containerd + runc), podman, busybox-static, libseccomp2 (the process
#      sandboxes' guard loads it), and gcc + libc6-dev (the tests build a static probe,
#      tests/sandboxes/probe.c, to run inside sandboxes)
#   2. an offline busybox rootfs (no registry is reachable), imported into Docker, Podman, uDocker
#   3. uDocker set up offline (UDOCKER_TARBALL empty; it only stores images and makes containers:
#      the library runs their commands itself, so neither PRoot nor runc is needed for it)
#   4. dockerd with networking switched off (never the default setup: it rewrites the host
#      firewall), on a short socket path, and `podman system service` (Docker-compatible API,
#      containers without a network by default); an EXIT trap removes their containers, stops
#      both by pid and removes everything
#   5. examples/agent_repo_image.sh: the coding-agent example's image (busybox + the host's python3)
#
# Exports DOCKER_HOST, THUNDERSYNC_TEST_PODMAN_HOST, UDOCKER_DIR, UDOCKER_TARBALL,
# THUNDERSYNC_TEST_IMAGE and THUNDERSYNC_REQUIRE_SANDBOXES=1
# (missing engines then fail the tests instead of skipping them).

_ts_sb_start=$SECONDS
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends docker.io podman busybox-static libseccomp2 gcc libc6-dev >/dev/null

TS_SB_DIR=$(mktemp -d /tmp/tssb.XXXXXX)   # short: unix socket paths are limited to 107 bytes
chmod 700 "$TS_SB_DIR"
_ts_podman=(podman --root "$TS_SB_DIR/podman/root" --runroot "$TS_SB_DIR/podman/run" --storage-driver vfs)
_ts_sandboxes_cleanup() {
    docker ps -aq 2>/dev/null | xargs -r docker rm -f >/dev/null 2>&1 || true
    "${_ts_podman[@]}" rm -af -t 0 >/dev/null 2>&1 || true
    kill ${TS_SB_DOCKERD_PID:-} ${TS_SB_PODMAN_PID:-} 2>/dev/null || true
    for _ts_proc in /proc/[0-9]*; do  # Podman's per-container monitors (conmon), by pid
        [ "$(cat "$_ts_proc/comm" 2>/dev/null)" = conmon ] && grep -qaF "$TS_SB_DIR" "$_ts_proc/cmdline" 2>/dev/null \
            && kill "${_ts_proc#/proc/}" 2>/dev/null || true
    done
    wait ${TS_SB_DOCKERD_PID:-} ${TS_SB_PODMAN_PID:-} 2>/dev/null || true
    rm -rf "$TS_SB_DIR" || true
}
# Chain with an EXIT trap that may already be set, instead of replacing it.
_ts_prev_exit_trap=$(trap -p EXIT | sed -e "s/^trap -- '//" -e "s/' EXIT\$//")
trap "_ts_sandboxes_cleanup; ${_ts_prev_exit_trap:-true}" EXIT
export THUNDERSYNC_TEST_IMAGE=thundersync-test/busybox:1

# -- the offline busybox image: /bin/busybox, its applets, a user, a working tree -----------------
_ts_rootfs="$TS_SB_DIR/rootfs"
mkdir -p "$_ts_rootfs"/{bin,etc,root,tmp,work/src,home/sandbox}
cp /bin/busybox "$_ts_rootfs/bin/busybox"
for _ts_applet in $("$_ts_rootfs/bin/busybox" --list); do
    [ "$_ts_applet" = busybox ] || ln -s busybox "$_ts_rootfs/bin/$_ts_applet"
done
printf 'root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n' >"$_ts_rootfs/etc/passwd"
printf 'root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n' >"$_ts_rootfs/etc/group"
printf 'hello from the seed\n' >"$_ts_rootfs/work/README"
printf 'print("seed")\n' >"$_ts_rootfs/work/src/main.py"
chmod 1777 "$_ts_rootfs/tmp"
tar -C "$_ts_rootfs" -cf "$TS_SB_DIR/rootfs.tar" .

# -- uDocker, offline ---------------------------------------------------------------------------
export UDOCKER_DIR="$TS_SB_DIR/udocker" UDOCKER_TARBALL=""
udocker --allow-root import "$TS_SB_DIR/rootfs.tar" "$THUNDERSYNC_TEST_IMAGE" >/dev/null

# -- dockerd without any network setup ----------------------------------------------------------
mkdir -p "$TS_SB_DIR/docker"
export DOCKER_HOST="unix://$TS_SB_DIR/docker.sock"
dockerd --iptables=false --ip6tables=false --bridge=none --ip-forward=false --ip-masq=false \
    --data-root "$TS_SB_DIR/docker/root" --exec-root "$TS_SB_DIR/docker/exec" \
    --pidfile "$TS_SB_DIR/docker.pid" -H "$DOCKER_HOST" >"$TS_SB_DIR/dockerd.log" 2>&1 &
TS_SB_DOCKERD_PID=$!

# -- Podman's Docker-compatible service (the same DockerSandbox code is tested against it) -------
export CONTAINERS_CONF="$TS_SB_DIR/containers.conf"
# exit_command_delay: each exec's conmon otherwise lingers 5 minutes after the command ended.
printf '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]\nnetns = "none"\n[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\nexit_command_delay = 10\n' >"$CONTAINERS_CONF"
"${_ts_podman[@]}" import --quiet --change 'WORKDIR /work' --change 'CMD ["/bin/sh"]' \
    "$TS_SB_DIR/rootfs.tar" "$THUNDERSYNC_TEST_IMAGE" >/dev/null
export THUNDERSYNC_TEST_PODMAN_HOST="unix://$TS_SB_DIR/podman.sock"
# Started in $TS_SB_DIR: conmon writes files (an `oom` marker) into the service's working directory.
(cd "$TS_SB_DIR" && exec "${_ts_podman[@]}" system service --time=0 "$THUNDERSYNC_TEST_PODMAN_HOST" >"$TS_SB_DIR/podman.log" 2>&1) &
TS_SB_PODMAN_PID=$!


for _ts_i in $(seq 100); do
    docker version >/dev/null 2>&1 && break
    sleep 0.1
done
docker version --format 'dockerd {{.Server.Version}} ready' || { cat "$TS_SB_DIR/dockerd.log"; false; }
for _ts_i in $(seq 100); do
    DOCKER_HOST=$THUNDERSYNC_TEST_PODMAN_HOST docker version >/dev/null 2>&1 && break
    sleep 0.1
done
DOCKER_HOST=$THUNDERSYNC_TEST_PODMAN_HOST docker version --format 'podman {{.Server.Version}} ready' \
    || { cat "$TS_SB_DIR/podman.log"; false; }
docker import --change 'WORKDIR /work' --change 'CMD ["/bin/sh"]' \
    "$TS_SB_DIR/rootfs.tar" "$THUNDERSYNC_TEST_IMAGE" >/dev/null

# The coding-agent example's image (busybox + the host's python3) in Docker, Podman and uDocker:
# examples/agent_repo.toml runs as a docker test on it.
bash examples/agent_repo_image.sh

export THUNDERSYNC_REQUIRE_SANDBOXES=1
echo "sandboxes ready in $((SECONDS - _ts_sb_start))s: DOCKER_HOST=$DOCKER_HOST UDOCKER_DIR=$UDOCKER_DIR"
