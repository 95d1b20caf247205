# Shared settings and helpers of the simhost scripts (sourced, not run).
# shellcheck shell=bash

SIMHOST_IMAGE=${SIMHOST_IMAGE:-moe-bench-simhost:latest}
# shellcheck disable=SC2034  # used by the scripts that source this file
SIMHOST_DEFAULT_NAME=moe-bench-simhost

log() { echo "simhost: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
