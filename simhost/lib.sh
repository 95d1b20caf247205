# Shared settings and helpers of the simhost scripts (sourced, not run).
# shellcheck shell=bash

SIMHOST_IMAGE=${SIMHOST_IMAGE:-moe-bench-simhost:latest}
# shellcheck disable=SC2034  # used by the scripts that source this file
SIMHOST_DEFAULT_NAME=moe-bench-simhost

log() { echo "simhost: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# --- Helpers of the image builds (simhost/build-image, scripts/build-ee-image) ---------------

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

debian_mirror() {
    # The mirror this machine's own apt uses for $DEBIAN_SUITE (the caller sets it), so a local
    # mirror or proxy is honoured.
    [ -n "${SIMHOST_DEBIAN_MIRROR:-}" ] && { echo "$SIMHOST_DEBIAN_MIRROR"; return; }
    local found=""
    if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null; then
        # deb822 stanzas: take URIs of a stanza whose Suites list bookworm itself.
        found=$(awk -v suite="$DEBIAN_SUITE" '
            BEGIN { RS=""; FS="\n" }
            {
                uri=""; ok=0
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^URIs:/)   { split($i, a, /[ \t]+/); uri = a[2] }
                    if ($i ~ /^Suites:/) { n = split($i, s, /[ \t]+/); for (j = 2; j <= n; j++) if (s[j] == suite) ok = 1 }
                    if ($i ~ /^Enabled:[ \t]*no/) ok = 0
                }
                if (ok && uri != "") { print uri; exit }
            }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    fi
    if [ -z "$found" ] && [ -r /etc/apt/sources.list ]; then
        found=$(awk -v suite="$DEBIAN_SUITE" '
            $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                          if ($(i + 1) == suite) { print $i; exit } }' /etc/apt/sources.list || true)
    fi
    echo "${found:-http://deb.debian.org/debian}"
}

ensure_debootstrap() {
    # A fresh machine may not have it: Debian's package, as docker-engine installs docker.io.
    command -v debootstrap >/dev/null 2>&1 && return 0
    command -v apt-get >/dev/null 2>&1 ||
        die "debootstrap is not installed and apt-get is not available: install debootstrap, then re-run."
    log "installing debootstrap from Debian"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null ||
        die "could not install debootstrap with apt-get; install it, then re-run."
    command -v debootstrap >/dev/null 2>&1 || die "debootstrap is still not on PATH after installing it"
}
