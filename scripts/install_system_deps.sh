#!/usr/bin/env bash
# Installs what the system tests of the launch tier need on a fresh Debian/Ubuntu machine, as root:
#   slurm-wlm + munge  tests/launch/test_slurm.py starts its own slurmctld, slurmd and munged
#   iproute2           tests/launch/test_multinode.py joins two network namespaces with a veth pair
#   util-linux         nsenter/unshare: each SLURM test node gets its own network, host name and hosts file
# Idempotent: installs only what is missing, and configures nothing system-wide. The tests write
# their own slurm.conf, munge key and sockets in a temporary folder and use free ports, so they
# neither need nor disturb a SLURM or MUNGE service this machine may already run.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "install_system_deps.sh: run as root (e.g. sudo $0); it installs Debian packages" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "install_system_deps.sh: needs apt-get (Debian/Ubuntu); install slurm-wlm, munge and iproute2 yourself" >&2
    exit 1
fi

missing=()
for pair in slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge ip:iproute2 nsenter:util-linux unshare:util-linux; do
    tool=${pair%%:*} package=${pair##*:}
    if ! command -v "$tool" >/dev/null && [[ ! " ${missing[*]-} " =~ " $package " ]]; then
        missing+=("$package")
    fi
done

if [ ${#missing[@]} -gt 0 ]; then
    echo "install_system_deps.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The packages' own services are not needed (Debian may start them where systemd runs); the tests
# never talk to them. Show what the tests will use.
echo "install_system_deps.sh: ready: $(slurmctld -V), $(munged --version 2>&1 | head -n 1), $(ip -V)"
