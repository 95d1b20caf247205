# moe-bench-ops: two commands for a newcomer, `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
ANSIBLE_PLAYBOOK := $(VENV)/bin/ansible-playbook
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: demo test venv engine host-image host-up host-down lint unit payload-test molecule integration clean

## demo: build and start the simulated GPU host, run playbooks/moe_bench.yml against it end to end
demo: venv host-up
	$(ANSIBLE_PLAYBOOK) -i inventory/demo playbooks/moe_bench.yml

## test: the whole suite (lint, unit, payload, Molecule, integration)
test: venv host-image lint unit payload-test molecule integration

venv:
	scripts/bootstrap

engine:
	simhost/docker-engine

host-image: engine
	simhost/build-image

host-up: host-image
	simhost/up

host-down:
	simhost/down

lint: venv
	$(VENV)/bin/ansible-lint --profile production

unit: venv
	$(VENV)/bin/pytest -q tests/unit

payload-test: venv
	.venv-payload/bin/pytest -q tests/payload

molecule: venv host-image
	tests/run-molecule

integration: venv host-image
	$(VENV)/bin/pytest -q tests/integration

clean: host-down
	rm -rf results
