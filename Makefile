# Two entry points: `make serve` (install, then serve) and `make test` (install, then test).
# Both are idempotent: the install step re-runs only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
MODEL  ?= FunAudioLLM/Fun-CosyVoice3-0.5B-2512
ARGS   ?=
# torch: the CPU build 2.13.0 (on this workplace's disk; CI stays fast). On a GPU host
# set TORCH_SPEC="torch==2.11.0", or keep the environment's own torch with TORCH_SPEC=
# (the venv then sees the environment's packages), before `make`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: serve test install system-deps test-deps apt-missing clean

$(VENV)/.installed: pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	$(PYTHON) -m venv $(if $(TORCH_SPEC),,--system-site-packages) $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# What the gateway itself needs from the system: libopus (opuslib loads it at run time).
system-deps:
	@$(MAKE) --no-print-directory apt-missing PKGS="$$(ldconfig -p 2>/dev/null | grep -q 'libopus.so.0' || echo libopus0)"

# What only the tests need: the PostgreSQL server (the scale-out tests start a throwaway
# cluster; the gateway needs just the psycopg wheel), nginx (the cluster's load balancer on
# loopback) and Debian's chromium (the demo page's browser test, over the DevTools protocol).
test-deps:
	@PKGS=""; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || PKGS="$$PKGS postgresql"; \
	[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || PKGS="$$PKGS nginx-light"; \
	command -v chromium >/dev/null 2>&1 || PKGS="$$PKGS chromium"; \
	$(MAKE) --no-print-directory apt-missing PKGS="$$PKGS"

apt-missing:
	@if [ -n "$(strip $(PKGS))" ]; then \
	  echo "installing $(strip $(PKGS)) (apt)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(PKGS) >/dev/null; \
	fi

serve: install
	$(VENV)/bin/cosyvoice-gateway --model "$(MODEL)" $(ARGS)

test: install test-deps
	$(VENV)/bin/python -m pytest -p no:cacheprovider -rs tests

clean:
	rm -rf $(VENV)
