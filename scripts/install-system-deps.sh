#!/usr/bin/env bash
# System packages the test suite needs beyond Python, from Debian's archive:
#   prometheus (+ promtool)        a real Prometheus server for tests/deploy
#   postgresql                     a real PostgreSQL server (initdb + postgres in a temp dir) for the
#                                  shared review queue / job store tests
#   haproxy                        the load balancer of the fleet test (tests/service/system/test_fleet.py),
#                                  run with deploy/haproxy/haproxy.cfg on loopback ports
#   chromium + chromium-driver     a real headless browser for the reviewer page test
#   libb64-0d                      libb64.so.0d, which perf_analyzer (in the tritonclient wheel)
#                                  links; tests/service/system/test_triton_tools.py runs it
# Idempotent: installs only what is missing.
set -euo pipefail
missing=()
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
{ command -v initdb || ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 || missing+=(postgresql)
{ command -v haproxy || [ -x /usr/sbin/haproxy ]; } >/dev/null 2>&1 || missing+=(haproxy)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
{ ls /usr/lib/*/libb64.so.0d || ls /lib/*/libb64.so.0d; } >/dev/null 2>&1 || missing+=(libb64-0d)
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
$sudo_cmd apt-get update -qq
# policy-rc.d exit 101: packages must not start their own daemons (Prometheus on :9090, a
# PostgreSQL cluster, HAProxy); tests start theirs on free ports. Keep and restore an existing policy-rc.d.
backup=""
if [ -e /usr/sbin/policy-rc.d ]; then
  backup="$(mktemp)"
  $sudo_cmd cp -p /usr/sbin/policy-rc.d "$backup"
fi
printf '#!/bin/sh\nexit 101\n' | $sudo_cmd tee /usr/sbin/policy-rc.d >/dev/null
$sudo_cmd chmod +x /usr/sbin/policy-rc.d
status=0
$sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || status=$?
if [ -n "$backup" ]; then $sudo_cmd mv "$backup" /usr/sbin/policy-rc.d; else $sudo_cmd rm -f /usr/sbin/policy-rc.d; fi
exit "$status"
