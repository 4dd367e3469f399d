# ncina: the two commands a user needs are `make topo` and `make test`; both set up what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian packages the project uses at run time and in tests (Mininet, its Linux-bridge switch, links).
APT_PACKAGES ?= mininet bridge-utils iproute2 iptables ethtool gcc libc6-dev python3-venv python3-dev
PYTEST_ARGS ?=

.PHONY: help setup apt venv test lint topo clean

help:
	@echo "make topo    bring up the Mininet topology and train a model through the aggregator"
	@echo "make test    run the whole test suite (sets up apt packages and .venv first)"
	@echo "make lint    ruff"
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
	    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; \
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

venv: $(VENV)/.stamp

lint: venv
	$(VENV)/bin/ruff check .

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf build .pytest_cache .ruff_cache
