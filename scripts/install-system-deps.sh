#!/usr/bin/env bash
# System packages the test suite needs beyond Python: a real Prometheus server and promtool
# (Debian's `prometheus` package) for tests/deploy. Idempotent; does nothing when both exist.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
$sudo_cmd apt-get update -qq
# policy-rc.d exit 101: the package must not start its own daemon on :9090 (tests start theirs on
# a free port). Keep and restore a policy-rc.d the machine already has.
backup=""
if [ -e /usr/sbin/policy-rc.d ]; then
  backup="$(mktemp)"
  $sudo_cmd cp -p /usr/sbin/policy-rc.d "$backup"
fi
printf '#!/bin/sh\nexit 101\n' | $sudo_cmd tee /usr/sbin/policy-rc.d >/dev/null
$sudo_cmd chmod +x /usr/sbin/policy-rc.d
status=0
$sudo_cmd apt-get install -y -qq --no-install-recommends prometheus >/dev/null || status=$?
if [ -n "$backup" ]; then $sudo_cmd mv "$backup" /usr/sbin/policy-rc.d; else $sudo_cmd rm -f /usr/sbin/policy-rc.d; fi
exit "$status"
