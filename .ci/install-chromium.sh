#!/usr/bin/env bash
# Install Debian's chromium and chromium-driver for the tile-replay browser test, only when missing.
# Idempotent: does nothing when /usr/bin/chromium exists. Uses apt-get only (no browser download).
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium chromium-driver
/usr/bin/chromium --version
