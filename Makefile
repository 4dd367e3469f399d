# ncina: the two commands a user needs are `make topo` and `make test`; both set up what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian packages the project uses at run time and in tests (Mininet, its Linux-bridge switch, links,
# the C compiler for the cffi extensions, DPDK for the dpdk backend, tcpdump for `ncina topo --pcaps`,
# tshark for the dissector's tests; tshark's one debconf question, whether non-root users may
# capture, takes its default "no" under DEBIAN_FRONTEND=noninteractive).
APT_PACKAGES ?= mininet bridge-utils iproute2 iptables ethtool gcc libc6-dev python3-venv python3-dev \
	dpdk libdpdk-dev pkg-config tcpdump tshark
PYTEST_ARGS ?=
# make topo: star topology, INA+NC8 through the aggregator, then the gloo fp32 baseline (docs/topo.md).
# BW: link bandwidth in Mbit/s (empty: unshaped); LOSS: percent of packets lost per link direction;
# BACKEND: python|socket|dpdk|bmv2 (empty: ncina topo's default, socket; python in server mode);
# TOPO_ARGS: any other `ncina topo` options, e.g. --topo multi --aggregators 2.
WORKERS ?= 4
BACKEND ?=
BW ?= 100
LOSS ?= 0
EPOCHS ?= 10
MODEL ?= mlp
TOPO_ARGS ?=
# make dissector: where Wireshark (and tshark) look for a user's Lua plugins.
WIRESHARK_PLUGINS ?= $(HOME)/.local/lib/wireshark/plugins
# PROFILE: the job's profile (ncina --profile, docs/tofino.md). make topo PROFILE=tofino trains
# once more under the Tofino design and prints both profiles side by side (BACKEND=bmv2: the
# switch runs the Tofino program's twin, that run only); make p4 PROFILE=tofino compiles the
# twin. make p4: lanes per packet the P4 program is generated and compiled for (BACKEND=bmv2 uses
# the topology's K, 256 unless TOPO_ARGS says otherwise; the twin's K is up to 32, the dense
# layout's).
PROFILE ?= default
K ?= $(if $(filter tofino,$(PROFILE)),32,64)
# make p4-tofino: lanes per pass and device of the Tofino program (docs/tofino.md). By default the
# dense layout (pair registers, int32 results, a harvest pass on Tofino 1; docs/tofino.md,
# "Density") at 32 lanes, which fits Tofino's 12 stages (about 2 minutes of CPU); TOFINO_K=64: the
# dense layout's 64 elements per packet in two passes (fits; about 10 minutes, 8 GB); TOFINO_DENSE=
# (empty): one register per lane, 12 lanes (the largest K of that layout that fits); TOFINO_NC8=1:
# one register per lane with NC8 results re-compressed in egress, 7 lanes (the largest that fits).
TOFINO_DENSE ?= 1
TOFINO_NC8 ?=
TOFINO_K ?= $(if $(TOFINO_NC8),7,$(if $(TOFINO_DENSE),32,12))
TOFINO_TARGET ?= tofino

.PHONY: help setup apt venv test lint topo need-root p4 p4-tofino dissector stop clean

help:
	@echo "make topo    bring up the Mininet topology and train a model through the aggregator;"
	@echo "             PROFILE=tofino: once more under the Tofino design, both in the table"
	@echo "make test    run the whole test suite (sets up apt packages and .venv first)"
	@echo "make lint    ruff"
	@echo "make p4      generate and compile p4/ for K lanes into build/p4/k<K>/ (needs p4c-bm2-ss);"
	@echo "             PROFILE=tofino: the Tofino program's dense layout's v1model twin p4/twin/, K<=32"
	@echo "make p4-tofino  compile p4/tofino/ for TOFINO_K lanes with p4c-barefoot, print its resources;"
	@echo "             (default: the dense layout, pair registers, int32 results, 32 lanes;"
	@echo "             TOFINO_K=64 : 64 elements per packet, two passes of 32 lanes;"
	@echo "             TOFINO_DENSE= : one register per lane, 12 lanes;"
	@echo "             TOFINO_NC8=1 : one register per lane with NC8 results, 7 lanes)"
	@echo "make dissector  install the Wireshark dissector (tools/wireshark/ncina.lua) for this user"
	@echo "make stop    stop a running make topo (by the PID it recorded in runs/topo.pid)"
	@echo "make clean   remove build products (keeps runs/)"

setup: apt venv

# Install the missing Debian packages (root only; others get a list of what is missing).
apt:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q $$missing >/dev/null; \
	  else \
	    echo "missing Debian packages (root is needed to install them):$$missing"; \
	  fi; \
	fi

# The venv sees the system site-packages: Debian's Mininet lives there.
$(VENV)/.stamp: pyproject.toml
	@test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[train,test]'
	@touch $@

# The venv, with the C extensions built now rather than at first use (quick when nothing
# changed: they are cached by a hash of their sources, ncina/common/cbuild.py).
venv: $(VENV)/.stamp
	$(PY) -m ncina.common.cbuild

lint: venv
	$(VENV)/bin/ruff check .

test: setup
	$(VENV)/bin/ruff check .
	NCINA_P4_WARMUP=1 $(VENV)/bin/pytest $(PYTEST_ARGS)

# Mininet needs root: a non-root user gets one sentence, before anything is installed.
need-root:
	@[ "$$(id -u)" = 0 ] || { echo "make topo needs root: Mininet creates network namespaces, virtual links and a bridge."; exit 1; }

topo: need-root setup
	$(VENV)/bin/ncina topo --workers $(WORKERS) $(if $(BACKEND),--backend $(BACKEND)) $(if $(BW),--bw $(BW)) \
	  --loss $(LOSS) --epochs $(EPOCHS) --model $(MODEL) $(if $(filter-out default,$(PROFILE)),--profile $(PROFILE)) \
	  $(TOPO_ARGS)

# The P4 program for BMv2: generated lanes + p4c-bm2-ss --p4runtime-files (docs/bmv2.md).
p4: venv
	$(PY) -m ncina.aggregator.backends.bmv2.toolchain --k $(K) --profile $(PROFILE)

# The Tofino program: generated lanes + p4c-barefoot, and the pipeline resources it takes
# (docs/tofino.md); TOFINO_TARGET=tofino2 for Tofino 2.
p4-tofino: venv
	$(PY) -m ncina.aggregator.backends.tofino.toolchain --k $(TOFINO_K) --target $(TOFINO_TARGET) $(if $(TOFINO_NC8),--nc8,$(if $(TOFINO_DENSE),--dense,--one-per-lane))

# The Wireshark dissector: Wireshark and tshark load every .lua in this folder at start
# (docs/wireshark.md).
dissector:
	@install -D -m 644 tools/wireshark/ncina.lua $(WIRESHARK_PLUGINS)/ncina.lua
	@echo "installed $(WIRESHARK_PLUGINS)/ncina.lua: Wireshark and tshark decode UDP port 47000 as ncina (restart Wireshark, or Analyze > Reload Lua Plugins)"

stop:
	@if [ -f runs/topo.pid ]; then kill -TERM "$$(cat runs/topo.pid)" && echo "stopping make topo (pid $$(cat runs/topo.pid))"; \
	else echo "no make topo is running (runs/topo.pid is absent)"; fi

clean:
	rm -rf build logs .pytest_cache .ruff_cache
