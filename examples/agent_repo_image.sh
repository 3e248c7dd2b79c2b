#!/usr/bin/env bash
# Build the offline image that examples/agent_repo.toml runs its coding agent in:
#     bash examples/agent_repo_image.sh            # -> thundersync-agent/python:1 in every engine it finds
#
# No registry is reachable on the machines this library is tested on, so the image is made from the
# host: busybox (sh, grep, ls... from Debian's busybox-static) and the host's Debian python3 (its
# binary, the shared libraries it links and its standard library, tests left out), with /work as
# the working directory and a non-root user. About 30 MB; it builds in seconds. It is imported
# into Docker (DOCKER_HOST or the default socket), into Podman when THUNDERSYNC_TEST_PODMAN_HOST
# names its socket, and into uDocker when `udocker` is on PATH (UDOCKER_DIR is respected).
# IMAGE=name:tag overrides the name. Needs: /bin/busybox (apt install busybox-static), python3.
set -euo pipefail
IMAGE=${IMAGE:-thundersync-agent/python:1}
PYTHON=$(readlink -f "$(command -v python3.11 || command -v python3)")
case "$PYTHON" in
    /usr/bin/*) ;;
    *) PYTHON=$(readlink -f /usr/bin/python3) ;;  # the distribution's, not a venv's or pyenv's
esac
VERSION=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
WORK=$(mktemp -d /tmp/agent-image.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
ROOT="$WORK/rootfs"
mkdir -p "$ROOT"/{bin,etc,root,tmp,work,home/sandbox,usr/bin,usr/lib}
cp /bin/busybox "$ROOT/bin/busybox"
for applet in $("$ROOT/bin/busybox" --list); do
    [ "$applet" = busybox ] || ln -s busybox "$ROOT/bin/$applet"
done
cp "$PYTHON" "$ROOT/usr/bin/python$VERSION"
ln -s "python$VERSION" "$ROOT/usr/bin/python3"
ln -s "python$VERSION" "$ROOT/usr/bin/python"
# the shared libraries python and its extension modules link, at their own paths
for lib in $( { ldd "$PYTHON"; find "/usr/lib/python$VERSION/lib-dynload" -name '*.so' -exec ldd {} \; ; } 2>/dev/null \
        | grep -o '/[^ ]*\.so[^ ]*' | sort -u); do
    mkdir -p "$ROOT$(dirname "$lib")"
    cp -L "$lib" "$ROOT$lib"
done
tar -C / --exclude="usr/lib/python$VERSION/test" --exclude="usr/lib/python$VERSION/idlelib" \
    --exclude="usr/lib/python$VERSION/tkinter" --exclude="usr/lib/python$VERSION/ensurepip" \
    --exclude='__pycache__' -cf - "usr/lib/python$VERSION" | tar -C "$ROOT" -xf -
printf 'root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n' >"$ROOT/etc/passwd"
printf 'root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n' >"$ROOT/etc/group"
chmod 1777 "$ROOT/tmp"
"$ROOT/usr/bin/python$VERSION" -c 'pass' 2>/dev/null || true  # (runs with the host's loader: a smoke test only)
tar -C "$ROOT" -cf "$WORK/rootfs.tar" .

imported=""
if command -v docker >/dev/null && docker version >/dev/null 2>&1; then
    docker import --change 'WORKDIR /work' --change 'CMD ["/bin/sh"]' "$WORK/rootfs.tar" "$IMAGE" >/dev/null
    imported="$imported docker"
fi
if [ -n "${THUNDERSYNC_TEST_PODMAN_HOST:-}" ] && command -v docker >/dev/null; then
    DOCKER_HOST=$THUNDERSYNC_TEST_PODMAN_HOST docker import --change 'WORKDIR /work' --change 'CMD ["/bin/sh"]' \
        "$WORK/rootfs.tar" "$IMAGE" >/dev/null
    imported="$imported podman"
fi
if command -v udocker >/dev/null; then
    udocker_args=()
    [ "$(id -u)" = 0 ] && udocker_args+=(--allow-root)
    udocker "${udocker_args[@]}" rmi "$IMAGE" >/dev/null 2>&1 || true
    udocker "${udocker_args[@]}" import "$WORK/rootfs.tar" "$IMAGE" >/dev/null
    imported="$imported udocker"
fi
[ -n "$imported" ] || { echo "no container engine found (docker, podman, udocker): nothing imported" >&2; exit 1; }
echo "$IMAGE (python $VERSION, $(du -h "$WORK/rootfs.tar" | cut -f1)) imported into:$imported"
