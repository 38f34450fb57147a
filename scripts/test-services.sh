#!/usr/bin/env bash
# What the test suite needs outside Python, set up on a fresh Debian machine: NATS (JetStream) on
# 127.0.0.1:4222, Redis on 127.0.0.1:6379, and Chromium for the dashboard tests. Installs the
# Debian packages that are missing (apt-get update only if an install needs it) and starts the
# services that are not answering. Called by `make test` and so by .ci/run; safe to run again.
set -uo pipefail

say() { echo "test-services: $*" >&2; }
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

updated=0
install() {  # install Debian packages "$@" if apt-get can
    command -v apt-get >/dev/null || { say "no apt-get: install $* yourself"; return 1; }
    [ "$(id -u)" = 0 ] || { say "not root: install $* yourself (apt-get install $*)"; return 1; }
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "$@" >/dev/null 2>&1 && return 0
    if [ "$updated" = 0 ]; then
        updated=1
        apt-get update -q >/dev/null 2>&1
        apt-get install -y -q "$@" >/dev/null 2>&1 && return 0
    fi
    say "could not install $*"
    return 1
}

if ! listening 4222; then
    command -v nats-server >/dev/null || install nats-server
    if command -v nats-server >/dev/null; then
        mkdir -p /var/lib/nats-server /var/log 2>/dev/null
        start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server)" -- \
            -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log \
            || say "nats-server did not start"
    fi
fi
if ! listening 6379; then
    command -v redis-server >/dev/null || install redis-server
    if command -v redis-server >/dev/null; then
        mkdir -p /var/lib/redis /var/log/redis 2>/dev/null
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
            --dir /var/lib/redis --logfile /var/log/redis/ci.log || say "redis-server did not start"
    fi
fi
command -v chromium >/dev/null || install chromium || say "the dashboard tests need chromium"
command -v espeak-ng >/dev/null || install espeak-ng || say "the speech-to-text tests need espeak-ng"

for port in 4222 6379; do  # give the services a moment to listen
    for _ in $(seq 50); do listening "$port" && break; sleep 0.1; done
    listening "$port" || say "nothing listens on 127.0.0.1:$port: the tests that need it will fail"
done
exit 0
