# Two entry points: `make serve` (install, then serve) and `make test` (install, then test).
# Both are idempotent: the install step re-runs only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
MODEL  ?= FunAudioLLM/Fun-CosyVoice3-0.5B-2512
ARGS   ?=
# torch: the CPU build 2.13.0 (on this workplace's disk; CI stays fast). On a GPU host
# set TORCH_SPEC="torch==2.11.0" (or keep the image's torch: TORCH_SPEC=) before `make`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: serve test install system-deps clean

$(VENV)/.installed: pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# libopus for Opus frames (opuslib loads it at run time). For the scale-out tests only:
# the PostgreSQL server (they start a throwaway cluster of their own; the gateway itself
# only needs the psycopg client wheel) and nginx (the cluster's load balancer, run on
# loopback in front of two gateway processes). Debian's chromium for the demo page's
# browser test (tests/test_demo_page.py drives it over the DevTools protocol).
system-deps:
	@PKGS=""; \
	ldconfig -p 2>/dev/null | grep -q 'libopus.so.0' || PKGS="$$PKGS libopus0"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || PKGS="$$PKGS postgresql"; \
	[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || PKGS="$$PKGS nginx-light"; \
	command -v chromium >/dev/null 2>&1 || PKGS="$$PKGS chromium"; \
	if [ -n "$$PKGS" ]; then \
	  echo "installing$$PKGS (apt)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$PKGS >/dev/null; \
	fi

serve: install
	$(VENV)/bin/cosyvoice-gateway --model "$(MODEL)" $(ARGS)

test: install
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV)
