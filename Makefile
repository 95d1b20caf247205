# moe-bench-ops: two commands for a newcomer, `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
# Test files of the integration phase run at once, each against its own simulated host: most of
# a playbook run waits on SSH round trips and the hosts' own sleeps, so two overlap on 2 cores.
# A short --basetemp: SSH's ControlPath under a test's folder must fit a Unix socket's path.
INTEGRATION_WORKERS ?= 2
# Unit and payload tests are pure CPU (real ansible-playbook runs, the Triton interpreter): one
# worker per core.
TEST_WORKERS ?= 2
ANSIBLE_PLAYBOOK := $(VENV)/bin/ansible-playbook
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: demo test venv engine host-image host-up host-down controller-user ee-image lint unit payload-test compile-check molecule integration clean

## demo: build and start the simulated GPU host, run playbooks/moe_bench.yml against it end to end
demo: venv host-up
	$(ANSIBLE_PLAYBOOK) -i inventory/demo playbooks/moe_bench.yml

## test: the whole suite (lint, unit, payload, Molecule, integration), then one summary line
# The two images (simulated host, execution environment) are built beside lint, unit and payload
# tests, which need neither: their builds wait on downloads and the disk, the tests on the CPU.
# Molecule and the integration tests start once both images are there.
test: venv engine controller-user
	@mkdir -p .cache && rm -rf .cache/junit-*.xml .cache/molecule-recap.txt .cache/lint.txt .cache/lint.log .cache/images.* && touch .cache/test-run-started
	@status=0; \
	( started=$$(date +%s); $(MAKE) --no-print-directory host-image ee-image > .cache/images.log 2>&1; \
	  echo "$$? $$(( $$(date +%s) - started ))" > .cache/images.rc ) & images=$$!; \
	for target in lint unit payload-test; do \
		$(MAKE) --no-print-directory $$target || status=1; \
	done; \
	wait $$images; read -r images_rc images_s < .cache/images.rc; \
	if [ "$$images_rc" = 0 ]; then echo "make test: images ready ($$images_s s, built beside the tests; log .cache/images.log)"; \
	else tail -n 60 .cache/images.log; echo "make test: building the images failed after $$images_s s (log above, whole in .cache/images.log)"; status=1; fi; \
	for target in molecule integration; do \
		$(MAKE) --no-print-directory $$target || status=1; \
	done; \
	$(VENV)/bin/python scripts/test-summary || status=1; \
	exit $$status

venv:
	scripts/bootstrap

engine:
	simhost/docker-engine

host-image: engine
	simhost/build-image

## ee-image: the execution environment (execution-environment.yml) as a local image, rebuilt when its inputs change
ee-image: venv engine
	scripts/build-ee-image

host-up: host-image
	simhost/up

host-down:
	simhost/down

controller-user:
	scripts/controller-user

lint: venv
	mkdir -p .cache
	$(VENV)/bin/ansible-lint --profile production --nocolor 2>&1 | tee .cache/lint.log && echo pass > .cache/lint.txt || { echo fail > .cache/lint.txt; exit 1; }

unit: venv
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) tests/unit --junitxml=.cache/junit-unit.xml

payload-test: venv
	.venv-payload/bin/pytest -q -n $(TEST_WORKERS) -m "not full_compile_check and not gpu" tests/payload --junitxml=.cache/junit-payload.xml

## compile-check: every preset's kernel configurations compiled for sm_80/89/90/100/120, checked to fit, with the venv's Triton and the lowest supported (requirements/triton-floor.txt; a few minutes each; payload-test runs a one-minute subset)
compile-check: venv
	TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=files:tools .venv-payload/bin/python tools/compile_check.py --arch sm_80,sm_89,sm_90,sm_100,sm_120 --preset all
	TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=.venv-payload/triton-floor:files:tools .venv-payload/bin/python tools/compile_check.py --arch sm_80,sm_89,sm_90,sm_100,sm_120 --preset all

molecule: venv host-image
	tests/run-molecule

integration: venv host-image ee-image controller-user
	$(VENV)/bin/pytest -q -n $(INTEGRATION_WORKERS) --dist loadfile --basetemp=/tmp/moe-bench-it tests/integration --junitxml=.cache/junit-integration.xml

clean: host-down
	rm -rf results
